//! The guest tests' choice, script and verdict, without booting a guest.

use super::*;

#[test]
fn a_guest_passes_only_when_every_test_ran_and_passed() {
    let names: Vec<String> = ["a::x", "a::y", "b::z"].map(str::to_owned).to_vec();
    let all = verdict(&names, "0 a::x\n0 a::y\n0 b::z\n");
    assert!(all.passed());
    assert_eq!(all.to_string(), "3 passed");
    let mixed = verdict(&names, "0 a::x\nhung a::y\n");
    assert!(!mixed.passed());
    assert_eq!(
        mixed.to_string(),
        "1 passed, 1 hung (a::y), 1 not run (b::z)"
    );
    let failed = verdict(&names, "101 a::x\n0 a::y\n0 b::z\n");
    assert_eq!(failed.failed, ["a::x"]);
    assert!(!verdict(&names, "").passed());
    // A test running when the whole guest stopped: not passed, and said.
    let mut stalled = verdict(&names, "0 a::x\n");
    stalled.stalled.push(stalled.not_run.remove(0));
    assert!(!stalled.passed());
    assert_eq!(
        stalled.to_string(),
        "1 passed, 1 stalled the guest (a::y), 1 not run (b::z)"
    );
}

#[test]
fn the_script_bounds_each_test_and_records_its_status() {
    let names = vec!["guest::t".to_owned()];
    let s = guest_script(
        "cd /r",
        Path::new("/t"),
        &names,
        Path::new("/l"),
        Path::new("/res"),
    );
    assert!(s.contains("setsid /t --exact guest::t --include-ignored"));
    assert!(s.contains(&format!("-lt {} ]", TEST_BOUND.as_secs())));
    assert!(s.contains("echo \"hung guest::t\" >> /res"));
    assert!(s.contains("echo \"$? guest::t\" >> /res"));
    // The kernel's patch sites armed before any test, and the script valid shell.
    let arm = s.find("sched/sched_switch").unwrap();
    assert!(arm < s.find("setsid").unwrap());
    let file = std::env::temp_dir().join(format!("guest-script-{}.sh", std::process::id()));
    std::fs::write(&file, &s).unwrap();
    let check = std::process::Command::new("sh")
        .arg("-n")
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        check.status.success(),
        "{}\n{s}",
        String::from_utf8_lossy(&check.stderr)
    );
}

/// A kernel oops on the guest's console is found and quoted from its first line (issue
/// 59: a guest that panics fails, with the oops in the verdict); a clean console has none.
#[test]
fn an_oops_on_the_console_is_quoted() {
    let clean = "[    1.0] virtme-ng-init: ok\n[    2.0] Run /init as init process\n";
    assert_eq!(first_oops(clean), None);
    let console = format!(
        "{clean}[   18.3] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n\
         [   18.3] CPU: 1 UID: 0 PID: 412 Comm: trainer\n\
         [   18.3] RIP: 0010:__bpf_prog_enter_recur+0x42/0x80\n\
         [   18.4] Kernel panic - not syncing: Fatal exception in interrupt\n"
    );
    let oops = first_oops(&console).unwrap();
    assert!(oops.starts_with("[   18.3] Oops: int3"), "{oops}");
    assert!(oops.contains("__bpf_prog_enter_recur"), "{oops}");
    assert!(oops.contains("Kernel panic"), "{oops}");
    let long = "line\n".repeat(100);
    let quoted = first_oops(&format!("BUG: unable to handle page fault\n{long}")).unwrap();
    assert_eq!(quoted.lines().count(), OOPS_LINES);
}
