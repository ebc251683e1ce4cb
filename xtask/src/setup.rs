//! `cargo xtask setup`: installs what is missing, says what it does, changes nothing that
//! is already there.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// The NCCL release the real-library test uses (the PyPI wheel nvidia-nccl-cu12).
pub const REAL_NCCL_VERSION: &str = "2.28.9";

fn say(what: &str, status: &str) {
    eprintln!("setup: {what:<44} {status}");
}

pub fn output(cmd: &mut Command) -> String {
    cmd.output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from)
}

/// Where downloads are cached: outside the clone, so CI and later sessions reuse them.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("NCCLTRACE_CACHE")
        .map_or_else(|| home().join(".cache/nccltrace"), PathBuf::from)
}

fn nightly() -> anyhow::Result<()> {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"]));
    if toolchains.lines().any(|l| l.starts_with("nightly")) {
        say("rustup nightly toolchain", "present");
    } else {
        say("rustup nightly toolchain", "installing");
        super::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    let components = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        "nightly",
    ]));
    if components.lines().any(|l| l.starts_with("rust-src")) {
        say("rust-src for nightly", "present");
    } else {
        say("rust-src for nightly", "installing");
        super::run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

const APT_PACKAGES: [&str; 12] = [
    "xz-utils",
    // GNU time: a test compares the agent's own peak memory with the kernel's figure.
    "time",
    "chromium",
    "llvm-22-dev",
    "libpolly-22-dev",
    "clang",
    "make",
    "bpftool",
    "gcc",
    // A real Prometheus (and its promtool) that the `--metrics` test scrapes the agent with.
    "prometheus",
    // A real CPython (Debian 12: 3.11) whose frames the Python tests walk, and its headers,
    // whose offsets the layout table is checked against.
    "python3",
    "python3-dev",
];

fn apt() -> anyhow::Result<()> {
    apt_packages(
        "Debian packages (LLVM 22, clang, bpftool, chromium, prometheus, python3)",
        &APT_PACKAGES,
    )
}

/// Installs those of `packages` that are missing (Debian's, with apt-get).
pub fn apt_packages(what: &str, packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            !output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .contains("install ok installed")
        })
        .collect();
    if missing.is_empty() {
        say(what, "present");
        return Ok(());
    }
    if !is_root() {
        bail!(
            "{what}: {} missing, and installing needs root",
            missing.join(" ")
        );
    }
    say(what, &format!("installing {}", missing.join(" ")));
    super::run(Command::new("apt-get").arg("update").arg("-q"))?;
    super::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn bpf_linker() -> anyhow::Result<()> {
    let have = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if have {
        say("bpf-linker", "present");
        return Ok(());
    }
    say(
        "bpf-linker (LLVM 22)",
        "building with cargo install (a few minutes)",
    );
    let path = format!(
        "/usr/lib/llvm-22/bin:{}",
        std::env::var("PATH").unwrap_or_default()
    );
    super::run(
        Command::new("cargo")
            .args([
                "install",
                "bpf-linker",
                "--locked",
                "--no-default-features",
                "--features",
                "llvm-22",
            ])
            .env("PATH", path),
    )
}

fn tracefs() -> anyhow::Result<()> {
    if Path::new("/sys/kernel/tracing/events").is_dir() {
        say("tracefs", "mounted");
        return Ok(());
    }
    if !is_root() {
        say(
            "tracefs",
            "not mounted (nccltrace mounts it when run as root)",
        );
        return Ok(());
    }
    say("tracefs", "mounting at /sys/kernel/tracing");
    super::run(Command::new("mount").args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"]))
}

/// Whether we run as root.
pub fn is_root() -> bool {
    output(Command::new("id").arg("-u")).trim() == "0"
}

/// The real libnccl.so.2 from the nvidia-nccl-cu12 wheel, downloaded once into the cache.
pub fn real_nccl() -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join(format!("nvidia-nccl-cu12-{REAL_NCCL_VERSION}"));
    let lib = dir.join("libnccl.so.2");
    if lib.is_file() {
        say(&format!("real libnccl.so.2 {REAL_NCCL_VERSION}"), "cached");
        return Ok(lib);
    }
    let wheels = cache_dir().join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let find_wheel = || -> Option<PathBuf> {
        std::fs::read_dir(&wheels)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.starts_with(&format!("nvidia_nccl_cu12-{REAL_NCCL_VERSION}-"))
                        && Path::new(n)
                            .extension()
                            .is_some_and(|e| e.eq_ignore_ascii_case("whl"))
                })
            })
    };
    if find_wheel().is_none() {
        say(
            &format!("nvidia-nccl-cu12=={REAL_NCCL_VERSION} wheel"),
            "downloading (~300 MB, once)",
        );
        super::run(
            Command::new("python3")
                .args([
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                ])
                .args([
                    "--platform",
                    "manylinux_2_18_x86_64",
                    "--platform",
                    "manylinux2014_x86_64",
                ])
                .args(["--python-version", "3.12", "-d"])
                .arg(&wheels)
                .arg(format!("nvidia-nccl-cu12=={REAL_NCCL_VERSION}")),
        )?;
    }
    let Some(wheel) = find_wheel() else {
        bail!("no nvidia-nccl-cu12 wheel in {}", wheels.display())
    };
    say(
        "extracting libnccl.so.2 from the wheel",
        &wheel.display().to_string(),
    );
    std::fs::create_dir_all(&dir)?;
    let script = "import sys, zipfile\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        name = next(n for n in z.namelist() if n.endswith('/lib/libnccl.so.2'))\n\
        open(sys.argv[2] + '.part', 'wb').write(z.read(name))\n";
    super::run(
        Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&wheel)
            .arg(&lib),
    )?;
    std::fs::rename(lib.with_extension("2.part"), &lib)
        .or_else(|_| std::fs::rename(format!("{}.part", lib.display()), &lib))
        .context("moving libnccl.so.2 into place")?;
    Ok(lib)
}

/// The speedscope release the trace.json check loads in headless Chromium: an importer of
/// the Chrome trace format written by others, fetched once from the npm registry.
pub const SPEEDSCOPE_VERSION: &str = "1.22.2";

/// speedscope's web app (its `dist/release` folder), unpacked in the cache.
pub fn speedscope() -> anyhow::Result<PathBuf> {
    let dir = cache_dir().join(format!("speedscope-{SPEEDSCOPE_VERSION}"));
    let release = dir.join("package/dist/release");
    if release.join("index.html").is_file() {
        say(&format!("speedscope {SPEEDSCOPE_VERSION} (npm)"), "cached");
        return Ok(release);
    }
    say(
        &format!("speedscope {SPEEDSCOPE_VERSION} (npm)"),
        "downloading",
    );
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if Command::new("npm").arg("--version").output().is_err() {
        // Node.js may come from elsewhere than Debian (its npm then conflicts): only when
        // there is no npm at all.
        say("npm", "installing (Debian)");
        super::run(
            Command::new("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends", "npm"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    super::run(
        Command::new("npm")
            .args([
                "pack",
                "--silent",
                &format!("speedscope@{SPEEDSCOPE_VERSION}"),
            ])
            .current_dir(&dir),
    )?;
    let tarball = dir.join(format!("speedscope-{SPEEDSCOPE_VERSION}.tgz"));
    super::run(
        Command::new("tar")
            .arg("xzf")
            .arg(&tarball)
            .current_dir(&dir),
    )?;
    if !release.join("index.html").is_file() {
        bail!("speedscope {SPEEDSCOPE_VERSION} has no dist/release/index.html");
    }
    Ok(release)
}

/// cargo-fuzz, for the fuzz targets in `fuzz/`.
pub fn cargo_fuzz() -> anyhow::Result<()> {
    let have = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if have {
        say("cargo-fuzz", "present");
        return Ok(());
    }
    say(
        "cargo-fuzz",
        "building with cargo install (a minute or two)",
    );
    super::run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))
}

/// Installs whatever is missing.
pub fn run(_root: &Path) -> anyhow::Result<()> {
    if is_root() {
        apt()?;
    } else {
        say("Debian packages", "skipped (not root)");
    }
    nightly()?;
    bpf_linker()?;
    tracefs()?;
    speedscope()?;
    cargo_fuzz()?;
    // The guests of `cargo xtask vm-test` (and of the guest step of `cargo xtask test`).
    if is_root() {
        super::vm::setup()?;
        for (series, _) in super::vm::KERNELS {
            super::vm::kernel(series)?;
        }
    }
    Ok(())
}
