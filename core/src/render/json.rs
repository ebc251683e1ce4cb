//! JSON objects written field by field, for the outputs written once per step or per
//! event (steps.json's rows, trace.json's events): keys are written as they are (they are
//! fixed names that need no escaping), integers through `itoa`, and only strings and
//! floats go through serde_json, so the bytes are the ones serde_json would write.
//! On a recording of 300,000 one-call steps this is what the report's time went to.

use std::io::{self, Write};

use serde::Serialize;

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
    pub(crate) fn key(&mut self, key: &str) -> io::Result<&mut W> {
        debug_assert!(plain(key), "{key:?} needs escaping");
        if !self.first {
            self.out.write_all(b",")?;
        }
        self.first = false;
        self.out.write_all(b"\"")?;
        self.out.write_all(key.as_bytes())?;
        self.out.write_all(b"\":")?;
        Ok(self.out)
    }

    #[inline]
    pub(crate) fn u64(&mut self, key: &str, v: u64) -> io::Result<()> {
        let out = self.key(key)?;
        out.write_all(itoa::Buffer::new().format(v).as_bytes())
    }

    #[inline]
    pub(crate) fn i64(&mut self, key: &str, v: i64) -> io::Result<()> {
        let out = self.key(key)?;
        out.write_all(itoa::Buffer::new().format(v).as_bytes())
    }

    /// An integer, or `null`.
    #[inline]
    pub(crate) fn opt_u64(&mut self, key: &str, v: Option<u64>) -> io::Result<()> {
        match v {
            Some(v) => self.u64(key, v),
            None => self.key(key)?.write_all(b"null"),
        }
    }

    /// An integer, or `null`.
    #[inline]
    pub(crate) fn opt_i64(&mut self, key: &str, v: Option<i64>) -> io::Result<()> {
        match v {
            Some(v) => self.i64(key, v),
            None => self.key(key)?.write_all(b"null"),
        }
    }

    /// A fixed string that needs no escaping (a phase, a category), quoted as it is.
    #[inline]
    pub(crate) fn plain(&mut self, key: &str, v: &str) -> io::Result<()> {
        debug_assert!(plain(v), "{v:?} needs escaping");
        let out = self.key(key)?;
        out.write_all(b"\"")?;
        out.write_all(v.as_bytes())?;
        out.write_all(b"\"")
    }

    /// A string, escaped.
    #[inline]
    pub(crate) fn str(&mut self, key: &str, v: &str) -> io::Result<()> {
        let out = self.key(key)?;
        serde_json::to_writer(out, v).map_err(io::Error::from)
    }

    /// Any value, through serde_json (floats, and what is rare enough not to matter).
    #[inline]
    pub(crate) fn value(&mut self, key: &str, v: &impl Serialize) -> io::Result<()> {
        let out = self.key(key)?;
        serde_json::to_writer(out, v).map_err(io::Error::from)
    }

    /// Ends the object.
    #[inline]
    pub(crate) fn end(self) -> io::Result<()> {
        self.out.write_all(b"}")
    }
}

/// Whether `s` is written in JSON as it is (no quote, backslash or control character).
fn plain(s: &str) -> bool {
    !s.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20)
}

/// The categories of a step or rank, as `Categories`'s `Serialize` writes them.
pub(crate) fn categories(out: &mut impl Write, c: &crate::attribute::Categories) -> io::Result<()> {
    let mut obj = Obj::new(out)?;
    for (name, value) in c.named() {
        obj.opt_u64(name, value)?;
    }
    obj.end()
}
