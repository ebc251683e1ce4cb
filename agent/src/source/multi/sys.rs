//! The `bpf(2)` calls aya does not make for us: loading BTF and a program with
//! `BPF_TRACE_UPROBE_MULTI` as its attach type, creating a uprobe-multi link, and reading a
//! program's run counts; each attribute laid out as the kernel's uapi header has it.

use std::os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd};

pub(super) const BPF_PROG_LOAD: libc::c_long = 5;
pub(super) const BPF_BTF_LOAD: libc::c_long = 18;
pub(super) const BPF_LINK_CREATE: libc::c_long = 28;
pub(super) const BPF_PROG_TYPE_KPROBE: u32 = 2;
pub(super) const BPF_TRACE_UPROBE_MULTI: u32 = 48;
pub(super) const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;

/// `union bpf_attr` for `BPF_PROG_LOAD`, as far as `func_info_cnt` (the kernel takes a
/// shorter attribute and reads the rest as zero).
#[repr(C)]
#[derive(Default)]
pub(super) struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
    prog_btf_fd: u32,
    func_info_rec_size: u32,
    func_info: u64,
    func_info_cnt: u32,
    _pad: u32,
}

/// `union bpf_attr` for `BPF_BTF_LOAD`.
#[repr(C)]
#[derive(Default)]
pub(super) struct BtfLoad {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
}

/// The object's BTF loaded into the kernel, as aya's loader makes it fit this kernel. The
/// kernel wants each function's BTF (`func_info`) with a program that passes one of its
/// functions to a helper (the `bpf_loop` walk of Python frames).
pub(super) fn load_btf(obj: &mut aya_obj::Object) -> Result<Option<OwnedFd>, String> {
    let Some(features) = aya::features().btf() else {
        return Ok(None);
    };
    let Some(btf) = obj
        .fixup_and_sanitize_btf(features)
        .map_err(|e| format!("BTF: {e}"))?
    else {
        return Ok(None);
    };
    let bytes = btf.to_bytes();
    let mut attr = BtfLoad {
        btf: bytes.as_ptr() as u64,
        btf_size: u32::try_from(bytes.len()).map_err(|_| "BTF over 4 GiB".to_owned())?,
        ..BtfLoad::default()
    };
    bpf(BPF_BTF_LOAD, &mut attr)
        .map(Some)
        .map_err(|e| format!("BPF_BTF_LOAD: {e}"))
}

/// A program's function records for `BPF_PROG_LOAD` (empty without BTF).
#[derive(Default)]
pub(super) struct FuncInfo {
    pub(super) bytes: Vec<u8>,
    pub(super) rec_size: u32,
    pub(super) count: u32,
}

/// `union bpf_attr` for `BPF_LINK_CREATE` of a uprobe-multi link.
#[repr(C)]
#[derive(Default)]
pub(super) struct LinkCreate {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    _pad: u32,
}

/// The `bpf` system call `cmd` with `attr` (a valid, fully initialised attribute for
/// `cmd` whose pointers are valid for the call); what it returned.
pub(super) fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    let size = std::mem::size_of::<T>();
    // SAFETY: `attr` is `size` bytes, an attribute for `cmd` as the caller made it.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}

/// [`sys_bpf`] for a command that returns a new descriptor.
pub(super) fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<OwnedFd> {
    let fd = sys_bpf(cmd, attr)?;
    let fd = RawFd::try_from(fd).map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: a new descriptor the kernel just gave us, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(super) fn load_insns(
    insns: u64,
    count: usize,
    license: &std::ffi::CStr,
    kern_version: u32,
    name: &str,
    btf: Option<(BorrowedFd<'_>, &FuncInfo)>,
    log: Option<&mut Vec<u8>>,
) -> std::io::Result<OwnedFd> {
    let mut attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: u32::try_from(count).unwrap_or(u32::MAX),
        insns,
        license: license.as_ptr() as u64,
        kern_version,
        expected_attach_type: BPF_TRACE_UPROBE_MULTI,
        ..ProgLoad::default()
    };
    if let Some((fd, info)) = btf
        && info.count > 0
    {
        attr.prog_btf_fd = u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX);
        attr.func_info_rec_size = info.rec_size;
        attr.func_info = info.bytes.as_ptr() as u64;
        attr.func_info_cnt = info.count;
    }
    for (slot, byte) in attr.prog_name.iter_mut().zip(name.bytes().take(15)) {
        *slot = byte;
    }
    if let Some(log) = log {
        attr.log_level = 1;
        attr.log_size = u32::try_from(log.len()).unwrap_or(u32::MAX);
        attr.log_buf = log.as_mut_ptr() as u64;
    }
    bpf(BPF_PROG_LOAD, &mut attr)
}

/// A uprobe-multi link of `prog` to `offsets` of the file `path`, each with its cookie,
/// in the process `pid` (0: every process); on return from the functions with `returns`.
pub(super) fn link(
    prog: BorrowedFd<'_>,
    path: &std::ffi::CStr,
    offsets: &[u64],
    cookies: Option<&[u64]>,
    returns: bool,
    pid: u32,
) -> std::io::Result<OwnedFd> {
    let mut attr = LinkCreate {
        prog_fd: u32::try_from(prog.as_raw_fd()).unwrap_or(u32::MAX),
        attach_type: BPF_TRACE_UPROBE_MULTI,
        path: path.as_ptr() as u64,
        offsets: offsets.as_ptr() as u64,
        cookies: cookies.map_or(0, |c| c.as_ptr() as u64),
        cnt: u32::try_from(offsets.len()).unwrap_or(u32::MAX),
        multi_flags: if returns {
            BPF_F_UPROBE_MULTI_RETURN
        } else {
            0
        },
        pid,
        ..LinkCreate::default()
    };
    bpf(BPF_LINK_CREATE, &mut attr)
}

/// The kernel's `bpf_prog_info` of the program `fd`.
pub(super) fn prog_info(fd: BorrowedFd<'_>) -> std::io::Result<aya_obj::generated::bpf_prog_info> {
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    #[repr(C)]
    struct InfoByFd {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    // SAFETY: a plain C struct of integers and pointers, for which zero is valid.
    let mut info: aya_obj::generated::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut attr = InfoByFd {
        bpf_fd: u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX),
        info_len: u32::try_from(std::mem::size_of_val(&info)).unwrap_or(0),
        info: std::ptr::from_mut(&mut info) as u64,
    };
    // The attribute points at `info`, of `info_len` bytes.
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_have_the_kernels_layout() {
        // uapi/linux/bpf.h: expected_attach_type ends at byte 72 of the load attribute,
        // func_info_cnt at 92 (line_info_rec_size, left zero, at 92); the BTF load
        // attribute's log level ends at 28; the uprobe_multi members start at 16 and pid
        // ends at 60 of the link one.
        assert_eq!(std::mem::size_of::<ProgLoad>(), 96);
        assert_eq!(std::mem::offset_of!(ProgLoad, prog_name), 48);
        assert_eq!(std::mem::offset_of!(ProgLoad, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(ProgLoad, prog_btf_fd), 72);
        assert_eq!(std::mem::offset_of!(ProgLoad, func_info), 80);
        assert_eq!(std::mem::offset_of!(ProgLoad, func_info_cnt), 88);
        assert_eq!(std::mem::offset_of!(BtfLoad, btf_size), 16);
        assert_eq!(std::mem::offset_of!(BtfLoad, btf_log_level), 24);
        assert_eq!(std::mem::offset_of!(LinkCreate, path), 16);
        assert_eq!(std::mem::offset_of!(LinkCreate, cookies), 40);
        assert_eq!(std::mem::offset_of!(LinkCreate, pid), 56);
    }
}
