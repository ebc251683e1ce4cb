//! The hosts' trace.json files joined into one, on the merged time axis: each host's
//! events are read one at a time (traces run to millions), their times moved by the host's
//! clock offset, their process ids moved apart (pids repeat across hosts), and process
//! names prefixed with the host.

use std::io::{self, BufRead, Read, Seek, Write};
use std::path::Path;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::HostClock;

/// Process ids of host `n` start at `n × PID_SPAN` (Linux pids stay below 2^22).
pub const PID_SPAN: u64 = 1 << 22;

/// One host's part of the merged trace.
pub struct Part<'a> {
    pub trace: &'a Path,
    pub wall_ns: i64,
    pub clock: &'a HostClock,
}

/// The `otherData` a host's trace ends with: its time 0 on the host's monotonic clock.
fn time_zero(path: &Path) -> io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(io::SeekFrom::Start(len.saturating_sub(1 << 16)))?;
    let mut tail = String::new();
    f.read_to_string(&mut tail)?;
    let at = tail
        .rfind("\"otherData\":")
        .ok_or_else(|| io::Error::other(format!("{}: no otherData at its end", path.display())))?;
    let rest = tail[at + "\"otherData\":".len()..].trim_end();
    let rest = rest.strip_suffix('}').unwrap_or(rest);
    let other: Value = serde_json::from_str(rest).map_err(io::Error::other)?;
    other["monotonic_ns_at_0"]
        .as_u64()
        .ok_or_else(|| io::Error::other(format!("{}: no monotonic_ns_at_0", path.display())))
}

/// Writes `out` (trace.json) from the hosts' traces; `base` is the merged axis's time 0.
pub fn merge_traces(out: &Path, parts: &[Part<'_>], other: &Value) -> io::Result<()> {
    let zeros = parts
        .iter()
        .map(|p| time_zero(p.trace))
        .collect::<io::Result<Vec<u64>>>()?;
    let base = parts
        .iter()
        .zip(&zeros)
        .map(|(p, z)| p.clock.to_merged(p.wall_ns, *z))
        .min()
        .unwrap_or(0);
    let mut w = io::BufWriter::with_capacity(1 << 20, std::fs::File::create(out)?);
    w.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[")?;
    let mut first = true;
    for (n, (p, zero)) in parts.iter().zip(&zeros).enumerate() {
        let input = io::BufReader::with_capacity(1 << 20, std::fs::File::open(p.trace)?);
        let mut shift = Shift {
            out: &mut w,
            first: &mut first,
            host: &p.clock.host,
            pid_base: n as u64 * PID_SPAN,
            to_merged: &|t: u64| p.clock.to_merged(p.wall_ns, t) - base,
            zero: *zero,
        };
        shift
            .read(input)
            .map_err(|e| io::Error::other(format!("reading {}: {e}", p.trace.display())))?;
    }
    write!(w, "\n],\"otherData\":")?;
    serde_json::to_writer(&mut w, other)?;
    writeln!(w, "}}")?;
    w.flush()
}

/// Moves one host's events onto the merged axis as they are read.
struct Shift<'a, W: Write> {
    out: &'a mut W,
    first: &'a mut bool,
    host: &'a str,
    pid_base: u64,
    /// A time of the host's clock on the merged axis (ns from its 0).
    to_merged: &'a dyn Fn(u64) -> i64,
    /// The host trace's time 0 on its clock.
    zero: u64,
}

impl<W: Write> Shift<'_, W> {
    fn read(&mut self, input: impl BufRead) -> Result<(), serde_json::Error> {
        let mut de = serde_json::Deserializer::from_reader(input);
        de::Deserializer::deserialize_map(&mut de, TopLevel(self))?;
        de.end()
    }

    fn event(&mut self, mut e: Value) -> io::Result<()> {
        if let Some(ts) = e.get("ts").and_then(Value::as_f64) {
            let t = self.zero as f64 + ts * 1e3;
            e["ts"] = Value::from((self.to_merged)(t.max(0.0) as u64) as f64 / 1e3);
        }
        if let Some(pid) = e.get("pid").and_then(Value::as_u64) {
            e["pid"] = Value::from(self.pid_base + pid);
        }
        if e["ph"] == "M"
            && e["name"] == "process_name"
            && let Some(name) = e["args"]["name"].as_str()
        {
            e["args"]["name"] = Value::from(format!("{}: {name}", self.host));
        }
        if !std::mem::take(self.first) {
            self.out.write_all(b",")?;
        }
        self.out.write_all(b"\n")?;
        serde_json::to_writer(&mut *self.out, &e)?;
        Ok(())
    }
}

struct TopLevel<'s, 'a, W: Write>(&'s mut Shift<'a, W>);

impl<'de, W: Write> Visitor<'de> for TopLevel<'_, '_, W> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a trace.json object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<String>()? {
            if key == "traceEvents" {
                map.next_value_seed(Events(&mut *self.0))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct Events<'s, 'a, W: Write>(&'s mut Shift<'a, W>);

impl<'de, W: Write> DeserializeSeed<'de> for Events<'_, '_, W> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, W: Write> Visitor<'de> for Events<'_, '_, W> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of trace events")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(e) = seq.next_element::<Value>()? {
            self.0.event(e).map_err(de::Error::custom)?;
        }
        Ok(())
    }
}
