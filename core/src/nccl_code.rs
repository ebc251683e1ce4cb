//! Where an NCCL library keeps a communicator's fields, read off its own machine code.
//!
//! `ncclCommCount(comm, &count)` and `ncclCommUserRank(comm, &rank)` end in `*out =
//! comm->field`: a 32-bit load from the communicator (the first argument, `rdi`, or a
//! register it was copied to) at a displacement, then a store of that register through
//! the second argument (`rsi`, or its copy). That displacement is where the library keeps
//! the field, whatever its version: the agent reads a communicator made before attach
//! there. `struct ncclComm` is private to NCCL and changes between versions, so no table
//! of offsets is kept.
//!
//! Only x86-64 is decoded, and only the few instruction forms that pattern needs (found
//! by a byte scan, not a disassembly): `mov r64, r64` copies of the two arguments, a
//! `mov r32, [base + disp8/disp32]` load and a `mov [base], r32` store within a few bytes
//! after it.

/// System V argument registers: the communicator, the out pointer.
const RDI: u8 = 7;
const RSI: u8 = 6;
/// The most bytes between the load and the store (a `xor ebx, ebx` of the return value
/// sits between them in NCCL 2.28.9; a REX-prefixed one takes 3).
const GAP: usize = 4;

/// The displacement from the communicator that the function at `code` returns through
/// its second argument, if exactly one is found.
#[must_use]
pub fn returned_field(code: &[u8]) -> Option<u32> {
    let copies = register_copies(code);
    let comm = aliases(RDI, &copies);
    let out = aliases(RSI, &copies);
    let mut found: Option<u32> = None;
    for at in 0..code.len() {
        let Some((dest, base, disp, len)) = load32(&code[at..]) else {
            continue;
        };
        if !comm.contains(&base) {
            continue;
        }
        let after = at + len;
        let stored = (after..=after + GAP)
            .filter_map(|s| code.get(s..).and_then(store32))
            .any(|(src, to)| src == dest && out.contains(&to));
        if stored {
            match found {
                Some(d) if d != disp => return None,
                _ => found = Some(disp),
            }
        }
    }
    found
}

/// The registers holding `reg`'s value through `mov r64, r64` copies (to a fixed point:
/// the scan does not know their order).
fn aliases(reg: u8, copies: &[(u8, u8)]) -> Vec<u8> {
    let mut set = vec![reg];
    loop {
        let before = set.len();
        for &(from, to) in copies {
            if set.contains(&from) && !set.contains(&to) {
                set.push(to);
            }
        }
        if set.len() == before {
            return set;
        }
    }
}

/// Every `mov r64, r64` in `code`: (source, destination).
fn register_copies(code: &[u8]) -> Vec<(u8, u8)> {
    code.windows(3)
        .filter_map(|w| {
            let (rex, op, modrm) = (w[0], w[1], w[2]);
            if rex & 0xf8 != 0x48 || modrm >> 6 != 0b11 {
                return None;
            }
            let reg = ((modrm >> 3) & 7) | ((rex & 0b100) << 1);
            let rm = (modrm & 7) | ((rex & 0b001) << 3);
            match op {
                // mov r/m64, r64
                0x89 => Some((reg, rm)),
                // mov r64, r/m64
                0x8b => Some((rm, reg)),
                _ => None,
            }
        })
        .collect()
}

/// An optional REX prefix without W (a 32-bit operand): its R and B bits, and its length.
fn rex32(code: &[u8]) -> (u8, u8, usize) {
    match code.first() {
        Some(&rex) if rex & 0xf8 == 0x40 => ((rex & 0b100) << 1, (rex & 0b001) << 3, 1),
        _ => (0, 0, 0),
    }
}

/// `mov r32, [base + disp]` at the start of `code`: (destination, base, displacement,
/// length). No SIB byte, no RIP-relative form.
fn load32(code: &[u8]) -> Option<(u8, u8, u32, usize)> {
    let (r, b, p) = rex32(code);
    if *code.get(p)? != 0x8b {
        return None;
    }
    let modrm = *code.get(p + 1)?;
    let (mode, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    if rm == 0b100 {
        return None;
    }
    let at = p + 2;
    let (disp, len) = match mode {
        0b01 => (u32::from(*code.get(at)?), 1),
        0b10 => (
            u32::from_le_bytes(code.get(at..at + 4)?.try_into().ok()?),
            4,
        ),
        _ => return None,
    };
    Some((reg | r, rm | b, disp, at + len))
}

/// `mov [base], r32` at the start of `code`: (source, base).
fn store32(code: &[u8]) -> Option<(u8, u8)> {
    let (r, b, p) = rex32(code);
    if *code.get(p)? != 0x89 {
        return None;
    }
    let modrm = *code.get(p + 1)?;
    let (mode, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    // [base] without displacement: mod 00, and neither SIB (100) nor RIP-relative (101).
    if mode != 0 || rm == 0b100 || rm == 0b101 {
        return None;
    }
    Some((reg | r, rm | b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What gcc -O2 makes of `*count = comm->nranks; return 0;` with the field 0x2c in:
    /// the load straight from rdi (disp8) and the store through rsi.
    #[test]
    fn a_plain_getter() {
        let code = [
            0x8b, 0x47, 0x2c, // mov eax, [rdi+0x2c]
            0x89, 0x06, // mov [rsi], eax
            0x31, 0xc0, // xor eax, eax
            0xc3, // ret
        ];
        assert_eq!(returned_field(&code), Some(0x2c));
    }

    /// NCCL's own form: both arguments copied to callee-saved registers past checks and
    /// calls, the field at a 32-bit displacement, the return value cleared between the
    /// load and the store, unrelated loads and stores around.
    #[test]
    fn arguments_kept_in_other_registers() {
        let code = [
            0x55, // push rbp
            0x49, 0x89, 0xf6, // mov r14, rsi
            0x49, 0x89, 0xfd, // mov r13, rdi
            0x8b, 0x43, 0x10, // mov eax, [rbx+0x10]: not the communicator
            0x89, 0x01, // mov [rcx], eax
            0xe8, 0, 0, 0, 0, // call
            0x41, 0x8b, 0x85, 0x38, 0x12, 0x20, 0x00, // mov eax, [r13+0x201238]
            0x31, 0xdb, // xor ebx, ebx
            0x41, 0x89, 0x06, // mov [r14], eax
            0xc3,
        ];
        assert_eq!(returned_field(&code), Some(0x20_1238));
    }

    /// Two different fields returned through the out pointer: no answer rather than a
    /// guess; none at all: none.
    #[test]
    fn ambiguous_or_absent() {
        let two = [
            0x8b, 0x47, 0x2c, 0x89, 0x06, 0x8b, 0x47, 0x30, 0x89, 0x06, 0xc3,
        ];
        assert_eq!(returned_field(&two), None);
        // The value stored through a register that is not the out pointer (rdx).
        let elsewhere = [0x8b, 0x47, 0x2c, 0x89, 0x02, 0xc3];
        assert_eq!(returned_field(&elsewhere), None);
        assert_eq!(returned_field(&[]), None);
    }
}
