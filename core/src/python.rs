//! Python frames as the recording keeps them: each interpreter's version and path, the
//! code objects its walks returned (name, file, line table), and how a walked frame becomes
//! `function (file:line)` in a stack. Finding the interpreter in a live process is the
//! agent's (`nccltrace::python`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// What the recording keeps about a target's interpreter.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PythonInfo {
    /// `3.11.7`, or what is known of it.
    pub version: String,
    /// The file the interpreter lies in, as the target sees it.
    pub path: String,
    /// Whether its frames are walked.
    pub frames: bool,
    /// Why not, when they are not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Named code objects by (pid, address).
pub type PythonCodes = std::collections::BTreeMap<(u32, u64), CodeInfo>;

/// A code object as the recording keeps it: enough to name any instruction of it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CodeInfo {
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
    /// `co_linetable` (the location table of CPython 3.11+).
    pub linetable: Vec<u8>,
    /// Where the instructions start, in bytes from the code object's address.
    pub adaptive: u32,
    /// CPython 3.10: the walk reports instruction indexes (`f_lasti`) and the line table
    /// is 3.10's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub v310: bool,
}

impl CodeInfo {
    /// The source line of `frame` (this code object's frame as the kernel walk reports
    /// it: instruction pointer minus the code object's address), when the table says one.
    #[must_use]
    pub fn line(&self, frame: crate::event::PyFrame) -> Option<i32> {
        let offset = frame.offset;
        if self.v310 {
            // The walk read 3.10's f_lasti (an instruction index) where later versions keep
            // a pointer, and subtracted the code object's address all the same.
            return match offset.wrapping_add(frame.code as u32) {
                // -1: the frame has not started.
                u32::MAX => Some(self.firstlineno),
                index => line_at_310(&self.linetable, self.firstlineno, index.checked_mul(2)?),
            };
        }
        let Some(unit) = offset.checked_sub(self.adaptive) else {
            // Before the first instruction: a frame just made (CPython points its
            // instruction pointer one unit before the start).
            return Some(self.firstlineno);
        };
        line_at(&self.linetable, self.firstlineno, unit / 2)
    }

    /// `qualname (file:line)`, the frame's name in stacks.
    #[must_use]
    pub fn frame(&self, frame: crate::event::PyFrame) -> String {
        let file = short_file(&self.filename);
        match self.line(frame) {
            Some(line) => format!("{} ({file}:{line})", self.qualname),
            None => format!("{} ({file})", self.qualname),
        }
    }
}

/// A source path as stacks show it: from the package on for installed packages
/// (`torch/_tensor.py`), else the file name (`train.py`).
#[must_use]
pub fn short_file(path: &str) -> &str {
    for marker in ["site-packages/", "dist-packages/"] {
        if let Some(i) = path.rfind(marker) {
            return &path[i + marker.len()..];
        }
    }
    path.rsplit('/').next().unwrap_or(path)
}

/// Names, on each traced call of `calls`, the Python frame it was made from: the
/// innermost Python frame of its entry stack (the record the entry program made just
/// after the call's start; `threads` and `stacks` as attribution made them).
pub fn name_call_sites(
    calls: &mut crate::attribute::Calls,
    threads: &[crate::attribute::ThreadDetail],
    stacks: &[crate::attribute::StackKey],
    codes: &PythonCodes,
) {
    if codes.is_empty() {
        return;
    }
    let index: HashMap<u32, usize> = threads
        .iter()
        .enumerate()
        .map(|(i, t)| (t.tid, i))
        .collect();
    for c in calls.iter_mut() {
        let Some(t) = index.get(&c.task.tid).map(|&i| &threads[i]) else {
            continue;
        };
        let i = t.call_stacks.partition_point(|(ts, _)| *ts < c.start_ns);
        let Some(&(_, stack)) = t.call_stacks.get(i).filter(|(ts, _)| *ts <= c.end_ns) else {
            continue;
        };
        let Some(s) = stacks.get(stack as usize) else {
            continue;
        };
        c.python =
            s.py.iter()
                .find(|f| !f.is_entry())
                .and_then(|f| Some(codes.get(&(s.pid, f.code))?.frame(*f)));
    }
}

/// The interpreter loop's C function: where Python frames go in a native stack.
const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

/// A native stack (innermost first) with the Python frames it was executing (innermost
/// first, entry markers between the runs of the interpreter loop, or each frame a run of
/// its own: `every_frame_a_run`, CPython 3.10) put in place of the
/// interpreter loop's frames: when there are as many runs as `_PyEval_EvalFrameDefault`
/// frames, each takes its run's place (the C frames between them stay); otherwise (a
/// native stack cut short, as without frame pointers) the C frames inside the innermost
/// run of the loop, then every Python frame, then the C frames outside the outermost.
pub fn merge_frames<'a>(
    native: Vec<std::borrow::Cow<'a, str>>,
    py: &[crate::event::PyFrame],
    every_frame_a_run: bool,
    name: impl Fn(crate::event::PyFrame) -> String,
) -> Vec<std::borrow::Cow<'a, str>> {
    if py.is_empty() {
        return native;
    }
    let runs: Vec<&[crate::event::PyFrame]> = if every_frame_a_run {
        // 3.10: each Python call is a call of the interpreter loop of its own.
        py.iter()
            .filter(|f| !f.is_entry())
            .map(std::slice::from_ref)
            .collect()
    } else {
        py.split(|f| f.is_entry())
            .filter(|run| !run.is_empty())
            .collect()
    };
    let evals: Vec<usize> = (0..native.len())
        .filter(|&i| native[i].starts_with(EVAL_FRAME))
        .collect();
    let named = |run: &[crate::event::PyFrame]| {
        run.iter()
            .map(|f| std::borrow::Cow::Owned(name(*f)))
            .collect::<Vec<_>>()
    };
    let mut out = Vec::with_capacity(native.len() + py.len());
    if !evals.is_empty() && evals.len() == runs.len() {
        let mut next = 0;
        for (i, frame) in native.into_iter().enumerate() {
            if evals.get(next) == Some(&i) {
                out.extend(named(runs[next]));
                next += 1;
            } else {
                out.push(frame);
            }
        }
        return out;
    }
    let (inner, outer) = match (evals.first(), evals.last()) {
        (Some(&first), Some(&last)) => (first, last + 1),
        _ => (native.len(), native.len()),
    };
    let mut native = native;
    let root = native.split_off(outer);
    native.truncate(inner);
    out.extend(native);
    out.extend(named(
        &py.iter()
            .copied()
            .filter(|f| !f.is_entry())
            .collect::<Vec<_>>(),
    ));
    out.extend(root);
    out
}

/// The line of the instruction at byte `offset` in a CPython 3.10 line table
/// (`Objects/lnotab_notes.txt` of 3.10): (bytecode delta, signed line delta) byte pairs,
/// each pair one address range; a line delta of -128 marks a range without a line.
#[must_use]
pub fn line_at_310(table: &[u8], firstlineno: i32, offset: u32) -> Option<i32> {
    let mut line = firstlineno;
    let mut end = 0u32;
    for pair in table.chunks_exact(2) {
        let start = end;
        end += u32::from(pair[0]);
        let delta = pair[1] as i8;
        let here = if delta == -128 {
            None
        } else {
            line += i32::from(delta);
            Some(line)
        };
        if (start..end).contains(&offset) {
            return here;
        }
    }
    None
}

/// Reads a location table varint: 6-bit chunks, low first, bit 6 set on all but the last.
fn varint(table: &[u8], at: &mut usize) -> Option<u32> {
    let mut value = 0u32;
    let mut shift = 0;
    loop {
        let b = *table.get(*at)?;
        *at += 1;
        value |= u32::from(b & 0x3f).checked_shl(shift)?;
        if b & 0x40 == 0 {
            return Some(value);
        }
        shift += 6;
    }
}

/// A signed varint: the sign in the lowest bit.
fn svarint(table: &[u8], at: &mut usize) -> Option<i32> {
    let v = varint(table, at)?;
    let magnitude = i32::try_from(v >> 1).ok()?;
    Some(if v & 1 == 1 { -magnitude } else { magnitude })
}

/// The line of code unit `unit` in a CPython 3.11+ location table (the format of
/// `Objects/locations.md`): entries of a first byte `1cccclll` (code `cccc`, covering
/// `lll + 1` code units) and, by code, a line delta and columns. `None` when the entry
/// has no location or the table ends before `unit`.
#[must_use]
pub fn line_at(table: &[u8], firstlineno: i32, unit: u32) -> Option<i32> {
    let mut line = firstlineno;
    let mut at = 0usize;
    let mut start = 0u32;
    while at < table.len() {
        let first = table[at];
        at += 1;
        if first & 0x80 == 0 {
            return None;
        }
        let code = (first >> 3) & 0x0f;
        let units = u32::from(first & 7) + 1;
        let located = match code {
            15 => false,
            14 => {
                line += svarint(table, &mut at)?;
                for _ in 0..3 {
                    varint(table, &mut at)?;
                }
                true
            }
            13 => {
                line += svarint(table, &mut at)?;
                true
            }
            10..=12 => {
                line += i32::from(code) - 10;
                at += 2;
                true
            }
            _ => {
                at += 1;
                true
            }
        };
        if (start..start + units).contains(&unit) {
            return located.then_some(line);
        }
        start += units;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_frames_replace_the_interpreter_loop() {
        use crate::event::PyFrame;
        let f = |code| PyFrame { code, offset: 0 };
        let entry = PyFrame::default();
        let name = |p: PyFrame| format!("py{}", p.code);
        let native = |names: &[&'static str]| -> Vec<std::borrow::Cow<'static, str>> {
            names.iter().map(|n| (*n).into()).collect()
        };
        // Two runs of the loop, two loop frames: each run in its place.
        let merged = merge_frames(
            native(&[
                "sync",
                "ffi_call",
                "_PyEval_EvalFrameDefault",
                "PyObject_Call",
                "_PyEval_EvalFrameDefault",
                "main",
            ]),
            &[f(1), f(2), entry, f(3), entry],
            false,
            name,
        );
        assert_eq!(
            merged,
            [
                "sync",
                "ffi_call",
                "py1",
                "py2",
                "PyObject_Call",
                "py3",
                "main"
            ]
        );
        // A native stack cut short (no loop frame in it): leaf C frames, then Python.
        let merged = merge_frames(
            native(&["sync", "ffi_call"]),
            &[f(1), entry, f(3), entry],
            false,
            name,
        );
        assert_eq!(merged, ["sync", "ffi_call", "py1", "py3"]);
        // Loop frames and runs that do not match: C frames between loop frames go.
        let merged = merge_frames(
            native(&[
                "sync",
                "_PyEval_EvalFrameDefault",
                "x",
                "_PyEval_EvalFrameDefault",
                "main",
            ]),
            &[f(1), f(2), entry],
            false,
            name,
        );
        assert_eq!(merged, ["sync", "py1", "py2", "main"]);
        // 3.10: every Python call is a loop frame of its own.
        let merged = merge_frames(
            native(&[
                "sync",
                "_PyEval_EvalFrameDefault",
                "x",
                "_PyEval_EvalFrameDefault",
            ]),
            &[f(1), f(2)],
            true,
            name,
        );
        assert_eq!(merged, ["sync", "py1", "x", "py2"]);
        // No Python frames: the native stack as it is.
        let merged = merge_frames(native(&["a", "_PyEval_EvalFrameDefault"]), &[], false, name);
        assert_eq!(merged, ["a", "_PyEval_EvalFrameDefault"]);
    }

    #[test]
    fn location_table_forms() {
        // One-line form (code 11: line + 1, 2 units), short form (code 0, 1 unit), no
        // location (code 15, 1 unit), long form (code 14: line - 2), no-column form
        // (code 13: line + 5).
        let table = [
            0x80 | (11 << 3) | 1,
            4,
            9,
            0x80,
            0x12,
            0x80 | (15 << 3),
            0x80 | (14 << 3),
            0x05, // svarint -2
            0x00,
            0x01,
            0x02,
            0x80 | (13 << 3) | 2,
            0x0a, // svarint +5
        ];
        let at = |u| line_at(&table, 10, u);
        assert_eq!((at(0), at(1), at(2)), (Some(11), Some(11), Some(11)));
        assert_eq!(
            (at(3), at(4), at(5), at(6), at(7)),
            (None, Some(9), Some(14), Some(14), Some(14))
        );
        assert_eq!(at(8), None);
        // Varints longer than one chunk: 0x41 0x01 = 1 + (1 << 6).
        let mut i = 0;
        assert_eq!(varint(&[0x41, 0x01], &mut i), Some(65));
        // A byte without the entry bit where an entry starts: the table is not understood.
        assert_eq!(line_at(&[0x01], 1, 0), None);
    }
}
