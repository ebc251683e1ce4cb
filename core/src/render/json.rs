//! JSON objects written field by field, for the outputs written once per step or per
//! event (steps.json's rows, trace.json's events): keys are written as they are (they are
//! fixed names that need no escaping), integers through `itoa`, and only strings and
//! floats go through serde_json, so the bytes are the ones serde_json would write.
//! On a recording of 300,000 one-call steps this is what the report's time went to.

use std::io::{self, Write};

use serde::Serialize;

/// A key made once, as it is written after an object's first field: `,"name":` (the
/// first field leaves the comma out). [`key!`] makes one from a literal; a row written
/// with them takes one write a key instead of four (the keys were half the writes of a
/// short-step run's steps.json and trace.json).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Key(pub(crate) &'static str);

/// The [`Key`] of a literal name.
macro_rules! key {
    ($name:literal) => {
        $crate::render::json::Key(concat!(",\"", $name, "\":"))
    };
}
pub(crate) use key;

/// What names a field: a [`Key`] made once, or a name (written piece by piece, for the
/// keys made at run time and the rare objects).
pub(crate) trait AsKey: Copy {
    fn write_key(self, out: &mut impl Write, first: bool) -> io::Result<()>;
}

impl AsKey for Key {
    #[inline]
    fn write_key(self, out: &mut impl Write, first: bool) -> io::Result<()> {
        debug_assert!(
            self.0.starts_with(",\"")
                && self.0.ends_with("\":")
                && plain(&self.0[2..self.0.len() - 2]),
            "{:?} is not a key",
            self.0
        );
        let bytes = self.0.as_bytes();
        out.write_all(if first { &bytes[1..] } else { bytes })
    }
}

impl AsKey for &str {
    #[inline]
    fn write_key(self, out: &mut impl Write, first: bool) -> io::Result<()> {
        debug_assert!(plain(self), "{self:?} needs escaping");
        out.write_all(if first { b"\"" } else { b",\"" })?;
        out.write_all(self.as_bytes())?;
        out.write_all(b"\":")
    }
}

/// The keys of the categories, in [`crate::attribute::NAMES`] order, with `suffix`
/// after each name.
pub(crate) fn category_keys(suffix: &str) -> [Key; crate::attribute::NAMES.len()] {
    crate::attribute::NAMES.map(|name| Key(format!(",\"{name}{suffix}\":").leak()))
}

/// An object being written: `{`, then fields, then [`Obj::end`].
pub(crate) struct Obj<'w, W: Write> {
    out: &'w mut W,
    first: bool,
}

impl<'w, W: Write> Obj<'w, W> {
    /// Starts an object.
    #[inline]
    pub(crate) fn new(out: &'w mut W) -> io::Result<Self> {
        out.write_all(b"{")?;
        Ok(Obj { out, first: true })
    }

    /// Writes `"key":` (with the comma before it but for the first field).
    #[inline]
    pub(crate) fn key(&mut self, key: impl AsKey) -> io::Result<&mut W> {
        key.write_key(self.out, self.first)?;
        self.first = false;
        Ok(self.out)
    }

    #[inline]
    pub(crate) fn u64(&mut self, key: impl AsKey, v: u64) -> io::Result<()> {
        let out = self.key(key)?;
        out.write_all(itoa::Buffer::new().format(v).as_bytes())
    }

    #[inline]
    pub(crate) fn i64(&mut self, key: impl AsKey, v: i64) -> io::Result<()> {
        let out = self.key(key)?;
        out.write_all(itoa::Buffer::new().format(v).as_bytes())
    }

    /// An integer, or `null`.
    #[inline]
    pub(crate) fn opt_u64(&mut self, key: impl AsKey, v: Option<u64>) -> io::Result<()> {
        match v {
            Some(v) => self.u64(key, v),
            None => self.key(key)?.write_all(b"null"),
        }
    }

    /// An integer, or `null`.
    #[inline]
    pub(crate) fn opt_i64(&mut self, key: impl AsKey, v: Option<i64>) -> io::Result<()> {
        match v {
            Some(v) => self.i64(key, v),
            None => self.key(key)?.write_all(b"null"),
        }
    }

    /// A fixed string that needs no escaping (a phase, a category), quoted as it is.
    #[inline]
    pub(crate) fn plain(&mut self, key: impl AsKey, v: &str) -> io::Result<()> {
        debug_assert!(plain(v), "{v:?} needs escaping");
        let out = self.key(key)?;
        out.write_all(b"\"")?;
        out.write_all(v.as_bytes())?;
        out.write_all(b"\"")
    }

    /// A string, escaped.
    #[inline]
    pub(crate) fn str(&mut self, key: impl AsKey, v: &str) -> io::Result<()> {
        let out = self.key(key)?;
        if plain(v) {
            out.write_all(b"\"")?;
            out.write_all(v.as_bytes())?;
            return out.write_all(b"\"");
        }
        serde_json::to_writer(out, v).map_err(io::Error::from)
    }

    /// Nanoseconds written as milliseconds, or `null`: the bytes serde_json writes for
    /// `ns as f64 / 1e6`, made from the integer (the float's formatting was a tenth of
    /// trace.json's time).
    #[inline]
    pub(crate) fn ms(&mut self, key: impl AsKey, ns: Option<u64>) -> io::Result<()> {
        let out = self.key(key)?;
        match ns {
            None => out.write_all(b"null"),
            Some(ns) => write_ms(out, ns),
        }
    }

    /// An integer as a quoted hex string, `"0x1f"` (what `format!("\"{v:#x}\"")` writes,
    /// without the formatting machinery: it was a tenth of trace.json's time).
    #[inline]
    pub(crate) fn hex(&mut self, key: impl AsKey, v: u64) -> io::Result<()> {
        let out = self.key(key)?;
        out.write_all(hex_quoted(v, &mut [0; 20]))
    }

    /// Any value, through serde_json (floats, and what is rare enough not to matter).
    #[inline]
    pub(crate) fn value(&mut self, key: impl AsKey, v: &impl Serialize) -> io::Result<()> {
        let out = self.key(key)?;
        serde_json::to_writer(out, v).map_err(io::Error::from)
    }

    /// Ends the object.
    #[inline]
    pub(crate) fn end(self) -> io::Result<()> {
        self.out.write_all(b"}")
    }
}

/// `ns / 1e6` as serde_json writes the f64: shortest round trip, `.0` for a whole number.
/// Below 10 ns serde_json writes an exponent (`1e-6`) and from 10^15 ns the float no
/// longer holds every nanosecond: both go through serde_json.
fn write_ms(out: &mut impl Write, ns: u64) -> io::Result<()> {
    if ns != 0 && !(10..1_000_000_000_000_000).contains(&ns) {
        return serde_json::to_writer(out, &(ns as f64 / 1e6)).map_err(io::Error::from);
    }
    out.write_all(itoa::Buffer::new().format(ns / 1_000_000).as_bytes())?;
    let mut frac = ns % 1_000_000;
    if frac == 0 {
        return out.write_all(b".0");
    }
    let mut digits = [b'.', b'0', b'0', b'0', b'0', b'0', b'0'];
    for d in digits[1..].iter_mut().rev() {
        *d = b'0' + (frac % 10) as u8;
        frac /= 10;
    }
    let len = digits.iter().rposition(|&d| d != b'0').unwrap_or(0) + 1;
    out.write_all(&digits[..len])
}

/// `"0x…"` for `v` (lowercase, no leading zeros), written into the end of `buf`.
fn hex_quoted(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len() - 1;
    buf[i] = b'"';
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[(v & 15) as usize];
        v >>= 4;
        if v == 0 {
            break;
        }
    }
    buf[i - 3..i].copy_from_slice(b"\"0x");
    &buf[i - 3..]
}

/// Whether `s` is written in JSON as it is (no quote, backslash or control character).
fn plain(s: &str) -> bool {
    !s.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20)
}

/// The categories of a step or rank, as `Categories`'s `Serialize` writes them.
pub(crate) fn categories(out: &mut impl Write, c: &crate::attribute::Categories) -> io::Result<()> {
    static KEYS: std::sync::LazyLock<[Key; crate::attribute::NAMES.len()]> =
        std::sync::LazyLock::new(|| category_keys(""));
    let mut obj = Obj::new(out)?;
    for (key, (_, value)) in KEYS.iter().zip(c.named()) {
        obj.opt_u64(*key, value)?;
    }
    obj.end()
}

#[cfg(test)]
mod tests {
    /// The hex strings are the formatter's.
    #[test]
    fn hex_as_the_formatter_writes_it() {
        let mut values = vec![0, 1, 15, 16, 255, 256, u64::MAX, u64::MAX - 1, 1 << 63];
        values.extend((0..64).map(|s| 0x9e37_79b9_7f4a_7c15u64 >> s));
        for v in values {
            let ours = super::hex_quoted(v, &mut [0; 20]).to_vec();
            assert_eq!(String::from_utf8(ours).unwrap(), format!("\"{v:#x}\""));
        }
    }

    /// The milliseconds written from the integer are serde_json's bytes for the float,
    /// over every magnitude.
    #[test]
    fn ms_as_serde_writes_the_float() {
        let mut values: Vec<u64> = (0..2_000).collect();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200_000 {
            // xorshift, spread over 0..2^60 by a random shift.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push(x >> (4 + x % 60));
        }
        for p in 0..19 {
            let t = 10u64.pow(p);
            values.extend([t - 1, t, t + 1, t * 3 / 2]);
        }
        for ns in values {
            let mut ours = Vec::new();
            super::write_ms(&mut ours, ns).unwrap();
            let serde = serde_json::to_string(&(ns as f64 / 1e6)).unwrap();
            assert_eq!(String::from_utf8(ours).unwrap(), serde, "{ns} ns");
        }
    }
}
