//! Rebuild the kernel programs when bpf-linker changes (it does the final link).
fn main() {
    // aya-build passes `--cfg bpf_target_arch="…"`; main.rs refuses all but x86_64.
    println!(
        "cargo::rustc-check-cfg=cfg(bpf_target_arch, values(\"x86_64\", \"aarch64\", \"arm\", \
         \"riscv64\", \"powerpc64\", \"s390x\", \"mips\", \"loongarch64\"))"
    );
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => println!("cargo:warning=bpf-linker not found ({err}); run `cargo xtask setup`"),
    }
}
