//! Tests of `python`.

use super::*;

#[test]
fn versions_and_names() {
    assert_eq!(version_of(0x030b_07f0), (3, 11, 7));
    assert_eq!(version_of(0x030c_03f0), (3, 12, 3));
    assert_eq!(minor_from_name("/usr/lib/libpython3.10.so.1.0"), Some(10));
    assert_eq!(minor_from_name("/usr/bin/python3.13"), Some(13));
    assert_eq!(minor_from_name("/usr/bin/python3"), None);
    assert!(layout(10).is_some() && layout(11).is_some() && layout(12).is_some());
    assert!(layout(9).is_none() && layout(13).is_none());
    assert_eq!(
        short_file("/opt/v/lib/python3.12/site-packages/torch/_tensor.py"),
        "torch/_tensor.py"
    );
    assert_eq!(short_file("/home/u/train.py"), "train.py");
    assert_eq!(short_file("<string>"), "<string>");
}

/// The table reader against CPython's own `co_lines()` for every code object of a
/// standard module, by the python3 on this machine (3.11+).
#[test]
fn location_tables_read_as_cpython_reads_them() {
    location_tables_of("python3");
    // 3.10's own table format, where pyenv keeps a 3.10 (these machines do).
    for (minor, dir) in pyenv_versions() {
        let python = dir.join("bin/python3");
        if minor == 10 && python.exists() {
            location_tables_of(python.to_str().unwrap());
        }
    }
}

/// The CPython 3 versions pyenv keeps here: (minor, its folder).
fn pyenv_versions() -> Vec<(u32, std::path::PathBuf)> {
    let root = std::env::var_os("PYENV_ROOT")
        .map_or_else(|| "/root/.pyenv".into(), std::path::PathBuf::from);
    std::fs::read_dir(root.join("versions"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let minor = name.strip_prefix("3.")?.split('.').next()?.parse().ok()?;
            Some((minor, entry.path()))
        })
        .collect()
}

/// [`location_tables_read_as_cpython_reads_them`] for the interpreter `python`.
fn location_tables_of(python: &str) {
    let script = r#"
import json, sys, inspect, json.decoder as m
out = []
def walk(c):
    out.append({"first": c.co_firstlineno, "table": c.co_linetable.hex(),
                "lines": [list(x) for x in c.co_lines()]})
    for k in c.co_consts:
        if hasattr(k, "co_linetable"): walk(k)
for name in ("json.decoder", "inspect", "argparse"):
    mod = __import__(name, fromlist=["x"])
    src = open(mod.__file__).read()
    walk(compile(src, mod.__file__, "exec"))
print(sys.version_info[1]); print(json.dumps(out))
"#;
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .output()
        .expect("python3 runs (cargo xtask setup installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let (minor, json) = text.split_once('\n').unwrap();
    let minor: u32 = minor.trim().parse().unwrap();
    assert!(minor >= 10, "needs CPython 3.10+");
    let codes: Vec<serde_json::Value> = serde_json::from_str(json).unwrap();
    let mut checked = 0;
    for c in &codes {
        let first = i32::try_from(c["first"].as_i64().unwrap()).unwrap();
        let hex = c["table"].as_str().unwrap();
        let table: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        for r in c["lines"].as_array().unwrap() {
            let (start, end) = (r[0].as_u64().unwrap(), r[1].as_u64().unwrap());
            let line = r[2].as_i64().map(|l| i32::try_from(l).unwrap());
            for unit in (start / 2)..(end / 2) {
                let unit = u32::try_from(unit).unwrap();
                let ours = if minor == 10 {
                    line_at_310(&table, first, unit * 2)
                } else {
                    line_at(&table, first, unit)
                };
                assert_eq!(ours, line, "{python}: unit {unit} of {c}");
                checked += 1;
            }
        }
    }
    assert!(checked > 10_000, "only {checked} code units checked");
}

/// The layout table and 3.13's debug-offset indices against `offsetof` in the headers
/// of every CPython on this machine (Debian's python3-dev, which `cargo xtask setup`
/// installs, and pyenv's), printed by tests/fixtures/pyoffsets.c.
#[test]
#[allow(clippy::too_many_lines, clippy::wildcard_imports)] // one table per version
fn layouts_match_the_interpreters_headers() {
    let mut includes = vec![std::path::PathBuf::from("/usr/include/python3.11")];
    for (minor, dir) in pyenv_versions() {
        includes.push(dir.join(format!("include/python3.{minor}")));
    }
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/pyoffsets.c");
    let dir = tempfile::tempdir().unwrap();
    let mut checked = Vec::new();
    for include in includes
        .iter()
        .filter(|i| i.join("internal/pycore_runtime.h").exists())
    {
        let exe = dir.path().join("pyoffsets");
        let built = std::process::Command::new("cc")
            .arg("-I")
            .arg(include)
            .arg(source)
            .arg("-o")
            .arg(&exe)
            .output()
            .unwrap();
        if !built.status.success() {
            // Versions whose internal headers differ (3.10 and older): not walked.
            continue;
        }
        let out = std::process::Command::new(&exe).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let v: HashMap<&str, u64> = text
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(' ')?;
                Some((k, v.parse().ok()?))
            })
            .collect();
        let minor = u32::try_from(v["minor"]).unwrap();
        let l = match minor {
            13 => {
                use debug::*;
                let pairs = [
                    ("debug_interpreters_head", INTERPRETERS_HEAD),
                    ("debug_interp_next", INTERP_NEXT),
                    ("debug_interp_threads_head", INTERP_THREADS_HEAD),
                    ("debug_tstate_next", TSTATE_NEXT),
                    ("debug_tstate_current_frame", TSTATE_CURRENT_FRAME),
                    ("debug_tstate_native_thread_id", TSTATE_NATIVE_THREAD_ID),
                    ("debug_frame_previous", FRAME_PREVIOUS),
                    ("debug_frame_executable", FRAME_EXECUTABLE),
                    ("debug_frame_instr_ptr", FRAME_INSTR_PTR),
                    ("debug_frame_owner", FRAME_OWNER),
                    ("debug_code_filename", CODE_FILENAME),
                    ("debug_code_qualname", CODE_QUALNAME),
                    ("debug_code_linetable", CODE_LINETABLE),
                    ("debug_code_firstlineno", CODE_FIRSTLINENO),
                    ("debug_code_adaptive", CODE_ADAPTIVE),
                    ("debug_unicode_ascii_size", UNICODE_ASCII_SIZE),
                    ("debug_free_threaded", FREE_THREADED),
                ];
                for (name, word) in pairs {
                    assert_eq!(v[name], word as u64 * 8, "3.13 {name}");
                }
                assert_eq!(v["debug_size"], WORDS as u64 * 8);
                // The layout 3.13 publishes, as the agent derives it: filled from
                // the header's own offsets.
                let mut words = vec![0u64; WORDS];
                words[0] = u64::from_le_bytes(*COOKIE);
                words[1] = 0x030d_00f0;
                let fields = [
                    (INTERPRETERS_HEAD, "runtime_interpreters_head"),
                    (INTERP_NEXT, "interp_next"),
                    (INTERP_THREADS_HEAD, "interp_threads_head"),
                    (TSTATE_NEXT, "tstate_next"),
                    (TSTATE_CURRENT_FRAME, "tstate_cframe"),
                    (TSTATE_NATIVE_THREAD_ID, "tstate_native_thread_id"),
                    (FRAME_PREVIOUS, "frame_previous"),
                    (FRAME_EXECUTABLE, "frame_code"),
                    (FRAME_INSTR_PTR, "frame_instr"),
                    (FRAME_OWNER, "frame_owner"),
                    (CODE_FILENAME, "code_filename"),
                    (CODE_QUALNAME, "code_qualname"),
                    (CODE_LINETABLE, "code_linetable"),
                    (CODE_FIRSTLINENO, "code_firstlineno"),
                    (CODE_ADAPTIVE, "code_adaptive"),
                    (UNICODE_ASCII_SIZE, "unicode_ascii_size"),
                ];
                for (word, name) in fields {
                    words[word] = v[name];
                }
                layout_from_debug_offsets(&words).expect("3.13's layout")
            }
            m => layout(m).unwrap_or_else(|| panic!("no layout for 3.{m}")),
        };
        let k = &l.kernel;
        let expect = [
            ("runtime_interpreters_head", l.runtime_interpreters_head),
            ("interp_next", l.interp_next),
            ("interp_threads_head", l.interp_threads_head),
            ("tstate_next", l.tstate_next),
            ("tstate_native_thread_id", l.tstate_native_thread_id),
            ("tstate_cframe", u64::from(k.tstate_cframe)),
            ("frame_previous", u64::from(k.frame_previous)),
            ("frame_code", u64::from(k.frame_code)),
            ("frame_instr", u64::from(k.frame_instr)),
            ("frame_owner", u64::from(k.frame_owner)),
            ("code_filename", l.code_filename),
            ("code_qualname", l.code_qualname),
            ("code_linetable", l.code_linetable),
            ("code_firstlineno", l.code_firstlineno),
            ("code_adaptive", u64::from(l.code_adaptive)),
            ("unicode_ascii_size", l.unicode_ascii_size),
            ("unicode_compact_size", l.unicode_compact_size),
            ("unicode_state", UNICODE_STATE),
            ("bytes_sval", BYTES_SVAL),
            ("object_type", OB_TYPE),
            ("var_size", VAR_SIZE),
        ];
        for (name, ours) in expect {
            match v.get(name) {
                Some(&theirs) => {
                    assert_eq!(theirs, ours, "3.{minor} {name} ({})", include.display());
                }
                // 3.10's frames have no owner, its code objects no adaptive copy.
                None => {
                    assert!(minor == 10 && ["frame_owner", "code_adaptive"].contains(&name));
                }
            }
        }
        if (11..13).contains(&minor) {
            assert_eq!(u64::from(k.cframe_current_frame), v["cframe_current_frame"]);
        }
        if minor == 11 {
            assert_eq!(u64::from(k.frame_is_entry), v["frame_is_entry"]);
        }
        checked.push(minor);
    }
    assert!(
        checked.contains(&11),
        "Debian's python3-dev headers were not found"
    );
    println!("checked 3.{checked:?}");
}
