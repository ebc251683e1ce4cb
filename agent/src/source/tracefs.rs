//! tracefs: mounted when missing, and the tracepoint field offsets of this kernel read from
//! each event's `format` file.

pub use nccltrace_core::procfs::field_offset;
use std::path::{Path, PathBuf};

use nccltrace_common::TpOffsets;

/// A tracefs problem.
#[derive(Debug, thiserror::Error)]
pub enum TracefsError {
    #[error(
        "tracefs is not mounted and mounting it failed ({source}): run \
         `mount -t tracefs tracefs /sys/kernel/tracing` as root"
    )]
    Mount {
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("tracepoint {event} has no field {field} in {path}")]
    Field {
        event: String,
        field: String,
        path: PathBuf,
    },
}

/// Where tracefs is, mounting it at `/sys/kernel/tracing` when it is nowhere.
pub fn ensure_mounted() -> Result<PathBuf, TracefsError> {
    for dir in ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"] {
        if Path::new(dir).join("events").is_dir() {
            return Ok(PathBuf::from(dir));
        }
    }
    let target = c"/sys/kernel/tracing";
    // SAFETY: all pointers are valid NUL-terminated strings; data may be null.
    let rc = unsafe {
        libc::mount(
            c"tracefs".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(TracefsError::Mount {
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(PathBuf::from("/sys/kernel/tracing"))
}

/// Reads a tracepoint's format file; `None` when this kernel lacks the tracepoint.
pub fn read_format(
    root: &Path,
    category: &str,
    event: &str,
) -> Result<Option<String>, TracefsError> {
    let path = root
        .join("events")
        .join(category)
        .join(event)
        .join("format");
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TracefsError::Read { path, source }),
    }
}

/// Offsets for every field the programs read, and which tracepoints exist here.
pub fn offsets(root: &Path) -> Result<(TpOffsets, Vec<&'static str>), TracefsError> {
    let mut o = TpOffsets::default();
    let mut available = Vec::new();
    for tp in nccltrace_common::names::TRACEPOINTS {
        let (category, event) = (tp.category, tp.event);
        let Some(format) = read_format(root, category, event)? else {
            continue;
        };
        let get = |field: &str| {
            field_offset(&format, field).ok_or_else(|| TracefsError::Field {
                event: event.to_owned(),
                field: field.to_owned(),
                path: root
                    .join("events")
                    .join(category)
                    .join(event)
                    .join("format"),
            })
        };
        match event {
            "sched_switch" => {
                o.switch_prev_pid = get("prev_pid")?;
                o.switch_prev_state = get("prev_state")?;
                o.switch_next_pid = get("next_pid")?;
            }
            "sched_waking" => {
                o.wakeup_pid = get("pid")?;
            }
            "sched_migrate_task" => {
                o.migrate_pid = get("pid")?;
                o.migrate_orig_cpu = get("orig_cpu")?;
                o.migrate_dest_cpu = get("dest_cpu")?;
            }
            "sched_process_fork" => o.fork_child_pid = get("child_pid")?,
            "sched_process_exit" => {
                o.exit_group_dead =
                    field_offset(&format, "group_dead").unwrap_or(nccltrace_common::FIELD_ABSENT);
            }
            // A raw tracepoint: its arguments, not the format's fields.
            "page_fault_user" => {}
            "mm_migrate_pages" => {
                o.pages_succeeded = get("succeeded")?;
                o.pages_failed = get("failed")?;
                o.pages_mode = get("mode")?;
                o.pages_reason = get("reason")?;
            }
            "sched_move_numa" => {
                o.move_pid = get("pid")?;
                o.move_tgid = get("tgid")?;
                o.move_src_cpu = get("src_cpu")?;
                o.move_src_nid = get("src_nid")?;
                o.move_dst_cpu = get("dst_cpu")?;
                o.move_dst_nid = get("dst_nid")?;
            }
            _ => {
                // sched_swap_numa and sched_stick_numa share a layout; check both agree.
                let fields = [
                    get("src_pid")?,
                    get("src_tgid")?,
                    get("src_cpu")?,
                    get("src_nid")?,
                    get("dst_pid")?,
                    get("dst_tgid")?,
                    get("dst_cpu")?,
                    get("dst_nid")?,
                ];
                let current = [
                    o.swap_src_pid,
                    o.swap_src_tgid,
                    o.swap_src_cpu,
                    o.swap_src_nid,
                    o.swap_dst_pid,
                    o.swap_dst_tgid,
                    o.swap_dst_cpu,
                    o.swap_dst_nid,
                ];
                if current != [0; 8] && current != fields {
                    continue;
                }
                [
                    o.swap_src_pid,
                    o.swap_src_tgid,
                    o.swap_src_cpu,
                    o.swap_src_nid,
                    o.swap_dst_pid,
                    o.swap_dst_tgid,
                    o.swap_dst_cpu,
                    o.swap_dst_nid,
                ] = fields;
            }
        }
        available.push(event);
    }
    Ok((o, available))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIGRATE: &str = "name: sched_migrate_task
ID: 361
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:__data_loc char[] comm;\toffset:8;\tsize:4;\tsigned:0;
\tfield:pid_t pid;\toffset:12;\tsize:4;\tsigned:1;
\tfield:int orig_cpu;\toffset:20;\tsize:4;\tsigned:1;
\tfield:char prev_comm[16];\toffset:40;\tsize:16;\tsigned:0;
";

    /// Offsets come from the format text, including `__data_loc` and array fields, and a
    /// name is matched whole (`pid` is not `common_pid`).
    #[test]
    fn parses_format() {
        assert_eq!(field_offset(MIGRATE, "pid"), Some(12));
        assert_eq!(field_offset(MIGRATE, "comm"), Some(8));
        assert_eq!(field_offset(MIGRATE, "orig_cpu"), Some(20));
        assert_eq!(field_offset(MIGRATE, "prev_comm"), Some(40));
        assert_eq!(field_offset(MIGRATE, "dest_cpu"), None);
    }

    /// Regression (issue 18): a kernel whose sched_process_exit has no `group_dead` field
    /// gave offset 0, so the program read `common_type` as the flag. Now the offset says
    /// the field is absent and the program leaves it 0.
    #[test]
    fn absent_group_dead_is_marked() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("events/sched/sched_process_exit");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("format"),
            "name: sched_process_exit\nformat:\n\tfield:unsigned short common_type;\toffset:0;\
             \tsize:2;\tsigned:0;\n\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
             \tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n",
        )
        .unwrap();
        let (o, available) = offsets(root.path()).unwrap();
        assert!(available.contains(&"sched_process_exit"), "{available:?}");
        assert_eq!(o.exit_group_dead, nccltrace_common::FIELD_ABSENT);
        std::fs::write(
            dir.join("format"),
            "format:\n\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\
             \tfield:bool group_dead;\toffset:28;\tsize:1;\tsigned:0;\n",
        )
        .unwrap();
        assert_eq!(offsets(root.path()).unwrap().0.exit_group_dead, 28);
    }
}
