//! What the scheduler's raw tracepoints need from the kernel's own types (its BTF,
//! `/sys/kernel/btf/vmlinux`): where `pid` and the task's CPU lie in `struct task_struct`,
//! and whether `sched_switch` passes `prev_state` (Linux 5.18+). Their arguments are task
//! pointers, where the formatted tracepoints hand over fields; the formatted ones build
//! their record at every context switch and wake-up of the host before any program runs.
//!
//! A scan of the BTF's type section, read once (a few MB): each type's size follows from
//! its kind, the names from the string section.

use std::path::Path;

/// Where the raw scheduler tracepoints read a task's pid and CPU (byte offsets in
/// `struct task_struct`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TaskFields {
    pub pid: u32,
    pub cpu: u32,
}

/// The kernel's BTF.
pub(super) const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// The fields, from the BTF at `path`, or why the raw tracepoints cannot be used.
pub(super) fn task_fields(path: &Path) -> Result<TaskFields, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("no kernel BTF ({}: {e})", path.display()))?;
    let btf = Btf::parse(&bytes)?;
    // `btf_trace_sched_switch`: a pointer to the prototype of its programs' functions,
    // whose first parameter is the context: (ctx, preempt, prev, next, prev_state).
    let params = btf
        .named(KIND_TYPEDEF, "btf_trace_sched_switch")
        .and_then(|id| btf.target(id))
        .filter(|id| btf.kind(*id) == Some(KIND_PTR))
        .and_then(|id| btf.target(id))
        .filter(|id| btf.kind(*id) == Some(KIND_FUNC_PROTO))
        .map(|id| btf.vlen(id))
        .ok_or("the kernel BTF has no prototype for sched_switch (btf_trace_sched_switch)")?;
    if params < 5 {
        return Err(
            "sched_switch does not pass prev_state on this kernel (Linux 5.18+ does)".to_owned(),
        );
    }
    let task = btf
        .named(KIND_STRUCT, "task_struct")
        .ok_or("the kernel BTF has no struct task_struct")?;
    let pid = btf
        .member_offset(task, &["pid"])
        .ok_or("struct task_struct has no pid in the kernel BTF")?;
    let cpu = btf
        .member_offset(task, &["cpu"])
        .or_else(|| btf.member_offset(task, &["thread_info", "cpu"]))
        .ok_or("struct task_struct has no cpu nor thread_info.cpu in the kernel BTF")?;
    Ok(TaskFields { pid, cpu })
}

const KIND_PTR: u32 = 2;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_FUNC_PROTO: u32 = 13;

/// A parsed view of a BTF blob: the type section, each type's start in it (by id; id 0 is
/// `void`), and the strings.
struct Btf<'a> {
    types: &'a [u8],
    starts: Vec<usize>,
    strings: &'a [u8],
}

fn word(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

impl<'a> Btf<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Btf<'a>, String> {
        let bad = |what: &str| format!("the kernel BTF is not readable here ({what})");
        if bytes.get(..2) != Some(&0xeb9f_u16.to_le_bytes()[..]) {
            return Err(bad("no little-endian BTF magic"));
        }
        let field = |at| {
            word(bytes, at)
                .map(|v| v as usize)
                .ok_or_else(|| bad("short header"))
        };
        let (header, type_off, type_len, str_off, str_len) =
            (field(4)?, field(8)?, field(12)?, field(16)?, field(20)?);
        let section = |off: usize, len: usize| {
            bytes
                .get(header + off..header + off + len)
                .ok_or_else(|| bad("a section past the end"))
        };
        let (types, strings) = (section(type_off, type_len)?, section(str_off, str_len)?);
        let mut starts = vec![0];
        let mut at = 0;
        while at < types.len() {
            starts.push(at);
            let info = word(types, at + 4).ok_or_else(|| bad("a truncated type"))?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let extra = match kind {
                // int, var, decl_tag: one word.
                1 | 14 | 17 => 4,
                // array: element type, index type, count.
                3 => 12,
                // struct, union, datasec, enum64: three words a member.
                4 | 5 | 15 | 19 => 12 * vlen,
                // enum, function prototype: two words an entry.
                6 | 13 => 8 * vlen,
                // ptr, fwd, typedef, volatile, const, restrict, func, float, type_tag.
                2 | 7..=12 | 16 | 18 => 0,
                _ => return Err(bad(&format!("unknown type kind {kind}"))),
            };
            at += 12 + extra;
        }
        Ok(Btf {
            types,
            starts,
            strings,
        })
    }

    fn info(&self, id: u32) -> Option<u32> {
        word(
            self.types,
            *self.starts.get(id as usize).filter(|_| id != 0)? + 4,
        )
    }

    fn kind(&self, id: u32) -> Option<u32> {
        self.info(id).map(|info| (info >> 24) & 0x1f)
    }

    fn vlen(&self, id: u32) -> u32 {
        self.info(id).map_or(0, |info| info & 0xffff)
    }

    fn name_at(&self, offset: u32) -> &[u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|b| *b == 0).unwrap_or(rest.len())]
    }

    /// The first type of `kind` named `name` (a struct with members: not a declaration).
    fn named(&self, kind: u32, name: &str) -> Option<u32> {
        (1..self.starts.len()).map(|id| id as u32).find(|id| {
            self.kind(*id) == Some(kind)
                && (kind != KIND_STRUCT || self.vlen(*id) > 0)
                && word(self.types, self.starts[*id as usize])
                    .is_some_and(|off| self.name_at(off) == name.as_bytes())
        })
    }

    /// The type a pointer, typedef or qualifier refers to.
    fn target(&self, id: u32) -> Option<u32> {
        word(self.types, self.starts.get(id as usize)? + 8)
    }

    /// Through typedefs and qualifiers to the type itself.
    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..16 {
            match self.kind(id) {
                Some(KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST) => {
                    id = self.target(id).unwrap_or(0);
                }
                _ => break,
            }
        }
        id
    }

    /// The byte offset of the member at `path` (nested member names) in struct `id`,
    /// looking into anonymous structs and unions on the way.
    fn member_offset(&self, id: u32, path: &[&str]) -> Option<u32> {
        let (first, rest) = path.split_first()?;
        let id = self.resolve(id);
        if !matches!(self.kind(id), Some(KIND_STRUCT | KIND_UNION)) {
            return None;
        }
        let start = self.starts[id as usize];
        let flagged = self.info(id)? >> 31 != 0;
        for i in 0..self.vlen(id) as usize {
            let at = start + 12 + 12 * i;
            let (name, ty, offset) = (
                word(self.types, at)?,
                word(self.types, at + 4)?,
                word(self.types, at + 8)?,
            );
            // With the kind flag, the top byte is a bitfield's size.
            let bits = if flagged {
                offset & 0x00ff_ffff
            } else {
                offset
            };
            let here = bits / 8;
            if name == 0 {
                if let Some(inner) = self.member_offset(ty, path) {
                    return Some(here + inner);
                }
            } else if self.name_at(name) == first.as_bytes() {
                return if rest.is_empty() {
                    Some(here)
                } else {
                    self.member_offset(ty, rest).map(|inner| here + inner)
                };
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob of `types` (each a list of words) and `strings`.
    fn blob(types: &[Vec<u32>], strings: &[u8]) -> Vec<u8> {
        let type_bytes: Vec<u8> = types
            .iter()
            .flatten()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let mut out = Vec::new();
        out.extend_from_slice(&0xeb9f_u16.to_le_bytes());
        out.extend_from_slice(&[1, 0]);
        for w in [
            24,
            0,
            type_bytes.len() as u32,
            type_bytes.len() as u32,
            strings.len() as u32,
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(&type_bytes);
        out.extend_from_slice(strings);
        out
    }

    fn info(kind: u32, vlen: u32) -> u32 {
        kind << 24 | vlen
    }

    /// Strings: 1 "int", 5 "cpu", 9 "thread_info", 21 "pid", 25 "task_struct",
    /// 37 "btf_trace_sched_switch", 60 "flags".
    const STRINGS: &[u8] =
        b"\0int\0cpu\0thread_info\0pid\0task_struct\0btf_trace_sched_switch\0flags\0";

    /// int; struct thread_info { u32 flags; u32 cpu; }; a declaration of task_struct;
    /// struct task_struct { thread_info; union { pid } at 2,000 bytes }; the sched_switch
    /// prototype with `params` parameters.
    fn kernel(params: u32) -> Vec<u8> {
        let mut proto = vec![0, info(13, params), 0];
        for _ in 0..params {
            proto.extend([0, 1]);
        }
        let types = vec![
            vec![1, info(1, 0), 4, 32],                        // 1 int
            vec![9, info(4, 2), 8, 60, 1, 0, 5, 1, 32],        // 2 thread_info
            vec![25, info(7, 0), 0],                           // 3 fwd task_struct
            vec![0, info(5, 1), 4, 21, 1, 0],                  // 4 union { pid }
            vec![25, info(4, 2), 4096, 9, 2, 0, 0, 4, 16_000], // 5 task_struct
            vec![37, info(8, 0), 7],                           // 6 typedef
            vec![0, info(2, 0), 8],                            // 7 ptr
            proto,                                             // 8 func_proto
        ];
        blob(&types, STRINGS)
    }

    fn fields_of(bytes: &[u8]) -> Result<TaskFields, String> {
        let dir = std::env::temp_dir().join(format!("nccltrace-btf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let path = dir.join(format!("vmlinux-{}", bytes.len()));
        std::fs::write(&path, bytes).map_err(|e| e.to_string())?;
        let fields = task_fields(&path);
        let _ = std::fs::remove_file(&path);
        fields
    }

    #[test]
    fn offsets_through_nested_and_anonymous_members() {
        assert_eq!(fields_of(&kernel(5)), Ok(TaskFields { pid: 2_000, cpu: 4 }));
    }

    #[test]
    fn kernels_before_5_18_keep_the_formatted_tracepoints() {
        let why = fields_of(&kernel(4)).unwrap_err();
        assert!(why.contains("does not pass prev_state"), "{why}");
    }

    #[test]
    fn a_damaged_blob_is_said_to_be() {
        let mut bytes = kernel(5);
        bytes[0] = 0;
        assert!(fields_of(&bytes).unwrap_err().contains("magic"));
        let why = fields_of(&kernel(5)[..30]).unwrap_err();
        assert!(why.contains("past the end"), "{why}");
    }

    /// This machine's kernel: the offsets are found (the live tests check them, through
    /// every switch they count).
    #[test]
    fn this_kernels_task_struct() {
        if !Path::new(VMLINUX_BTF).exists() {
            return;
        }
        let fields = task_fields(Path::new(VMLINUX_BTF)).unwrap();
        assert!(fields.pid > 0 && fields.pid < 16_384, "{fields:?}");
        assert!(fields.cpu < 16_384, "{fields:?}");
    }
}
