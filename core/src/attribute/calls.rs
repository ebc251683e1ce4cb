//! The traced calls waiting for their epoch, and an epoch's calls: kept in chunks.
//!
//! An epoch takes the calls that returned before its end, most of the buffer but not the
//! last ~10 ms (the reorder margin). In one vector, the calls kept were copied into a new
//! one every epoch: on a recording of 300,000 one-call steps, half the buffer each time, a
//! tenth of the attribution's time. In chunks, an epoch takes whole chunks and splits one.

use crate::event::Call;

/// Calls in chunks of at most [`CHUNK`] (the first may be shorter: the rest of a split).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    chunks: Vec<Vec<Call>>,
    len: usize,
}

/// Calls a chunk: 80 KiB, under glibc's 128-KiB threshold for memory mapped on its own.
const CHUNK: usize = 512;

impl Calls {
    pub fn push(&mut self, call: Call) {
        match self.chunks.last_mut() {
            Some(last) if last.len() < last.capacity() => last.push(call),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(call);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &Call> {
        self.chunks.iter().flatten()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Call> {
        self.chunks.iter_mut().flatten()
    }

    /// Moves every call of `other` after these.
    pub fn append(&mut self, other: &mut Calls) {
        self.len += std::mem::take(&mut other.len);
        self.chunks.append(&mut other.chunks);
    }

    /// Takes the calls `pick` picks, in order, and keeps the others, in order. When those
    /// picked come first (the usual case) no call is copied but the picked part of the
    /// chunk where the kept ones begin.
    #[must_use]
    pub fn take_where(&mut self, mut pick: impl FnMut(&Call) -> bool) -> Calls {
        let Some(k) = self.chunks.iter().position(|c| !c.iter().all(&mut pick)) else {
            return std::mem::take(self);
        };
        let at = self.chunks[k].iter().position(|c| !pick(c)).unwrap_or(0);
        let rest_kept = self.chunks[k][at..]
            .iter()
            .chain(self.chunks[k + 1..].iter().flatten())
            .all(|c| !pick(c));
        if rest_kept {
            let kept_first = self.chunks[k].split_off(at);
            let mut taken: Vec<Vec<Call>> = self.chunks.drain(..=k).collect();
            if taken.last().is_some_and(Vec::is_empty) {
                taken.pop();
            }
            self.chunks.insert(0, kept_first);
            let taken = Calls::from_chunks(taken);
            self.len -= taken.len;
            return taken;
        }
        let mut taken = Calls::default();
        for chunk in &mut self.chunks {
            for c in chunk.extract_if(.., |c| pick(c)) {
                taken.push(c);
            }
        }
        self.chunks.retain(|c| !c.is_empty());
        self.len -= taken.len;
        taken
    }

    fn from_chunks(chunks: Vec<Vec<Call>>) -> Calls {
        let len = chunks.iter().map(Vec::len).sum();
        Calls { chunks, len }
    }
}

impl From<Vec<Call>> for Calls {
    fn from(calls: Vec<Call>) -> Calls {
        Calls::from_chunks(if calls.is_empty() {
            Vec::new()
        } else {
            vec![calls]
        })
    }
}

impl FromIterator<Call> for Calls {
    fn from_iter<I: IntoIterator<Item = Call>>(iter: I) -> Calls {
        let mut calls = Calls::default();
        for c in iter {
            calls.push(c);
        }
        calls
    }
}

impl<'a> IntoIterator for &'a Calls {
    type Item = &'a Call;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Vec<Call>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.chunks.iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::{CHUNK, Calls};
    use crate::event::{Call, Func, Task};

    fn ends(calls: &Calls) -> Vec<u64> {
        calls.iter().map(|c| c.end_ns).collect()
    }

    fn calls(ends: impl IntoIterator<Item = u64>) -> Calls {
        let task = Task {
            tid: 1,
            tgid: 1,
            ..Task::default()
        };
        ends.into_iter()
            .map(|e| Call::new(task, Func::AllReduce, e, e))
            .collect()
    }

    /// Those picked first (the usual case, across chunks and within one), interleaved,
    /// none, all: order kept on both sides, the lengths right, and more pushed after a
    /// split go after the kept ones.
    #[test]
    fn take_where_keeps_order() {
        let n = 3 * CHUNK as u64 + 5;
        for until in [
            0,
            1,
            7,
            CHUNK as u64,
            CHUNK as u64 + 1,
            2 * CHUNK as u64 + 3,
            n,
        ] {
            let mut c = calls(0..n);
            let taken = c.take_where(|c| c.end_ns < until);
            assert_eq!(ends(&taken), (0..until).collect::<Vec<_>>(), "{until}");
            assert_eq!(ends(&c), (until..n).collect::<Vec<_>>(), "{until}");
            assert_eq!(
                (taken.len(), c.len()),
                (until as usize, (n - until) as usize)
            );
            c.append(&mut calls(n..n + 2));
            c.push(calls([n + 2]).iter().next().unwrap().clone());
            assert_eq!(ends(&c), (until..n + 3).collect::<Vec<_>>(), "{until}");
            assert_eq!(c.len(), (n + 3 - until) as usize);
        }
        let mut c = calls([1, 10, 2, 11, 3]);
        let taken = c.take_where(|c| c.end_ns < 10);
        assert_eq!((ends(&taken), ends(&c)), (vec![1, 2, 3], vec![10, 11]));
        assert_eq!((taken.len(), c.len()), (3, 2));
        assert!(!taken.is_empty() && Calls::default().is_empty());
    }
}
