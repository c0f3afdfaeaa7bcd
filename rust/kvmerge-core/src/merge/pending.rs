//! The pending reports: per rank a FIFO queue of reports in position order
//! (or a batch held whole), and (in indexed mode) per identity, per rank,
//! the list of its eligible reports threaded through the queue, so a step
//! only visits the identities its new, completing, cleared or expiring
//! reports touch.

use std::collections::VecDeque;

use super::report::{Position, Publication, Report};
use crate::identity::{Identity, IdentityMap};

/// A rank's batch, pending whole since `step`, in slot `slot` (see `held`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Held {
    pub slot: u32,
    pub step: u64,
}

/// No next report in an identity's list.
pub(super) const NONE: u64 = u64::MAX;

pub(super) struct Node {
    pub rep: Report,
    /// The next eligible report of the same identity on this rank (indexed mode).
    pub next: u64,
    /// False once used or cleared: the slot stays until it reaches the front.
    pub live: bool,
}

/// One rank's pending reports. Every report has a sequence number on its
/// rank (`base` is the front's); used or cleared reports in the middle stay
/// as dead nodes until they reach the front.
#[derive(Default)]
pub(super) struct Queue {
    pub nodes: VecDeque<Node>,
    pub base: u64,
    /// Sequence numbers of the live clears, in order: the first is the fence.
    pub clears: VecDeque<u64>,
}

impl Queue {
    pub fn end(&self) -> u64 {
        self.base + self.nodes.len() as u64
    }

    pub fn get(&self, seq: u64) -> &Node {
        &self.nodes[(seq - self.base) as usize]
    }

    pub fn get_mut(&mut self, seq: u64) -> &mut Node {
        &mut self.nodes[(seq - self.base) as usize]
    }

    /// Reports before this sequence number are eligible (before the fence).
    pub fn eligible_end(&self) -> u64 {
        self.clears.front().copied().unwrap_or_else(|| self.end())
    }

    pub fn push(&mut self, rep: Report) {
        if rep.clear {
            self.clears.push_back(self.end());
        }
        self.nodes.push_back(Node {
            rep,
            next: NONE,
            live: true,
        });
    }

    pub fn pop_front(&mut self) -> Option<Node> {
        let n = self.nodes.pop_front()?;
        self.base += 1;
        Some(n)
    }

    pub fn pop_dead(&mut self) {
        while self.nodes.front().is_some_and(|n| !n.live) {
            self.pop_front();
        }
    }

    pub fn clear(&mut self) {
        self.base = self.end();
        self.nodes.clear();
        self.clears.clear();
    }

    pub fn position(&self, seq: u64, rank: usize) -> (Position, Publication) {
        let rep = &self.get(seq).rep;
        ((rep.step, rep.idx, rank as u32), rep.publication())
    }
}

/// One rank's eligible reports of one identity: a list through its queue.
#[derive(Clone, Copy)]
pub(super) struct RankList {
    pub rank: u32,
    pub len: u32,
    pub head: u64,
    pub tail: u64,
}

pub(super) struct Entry {
    /// The ranks with an eligible report of the identity, by rank.
    pub lists: Vec<RankList>,
    /// Its replication factor (equal identities, equal events, equal factors).
    pub factor: u32,
    /// Already in `Index::touched`.
    pub touched: bool,
}

/// Per identity, its eligible reports on each rank, and the identities whose
/// eligible reports grew since their last completion check.
#[derive(Default)]
pub(super) struct Index {
    pub map: IdentityMap<Entry>,
    pub touched: Vec<Identity>,
}

impl Index {
    pub fn clear(&mut self) {
        self.map.clear();
        self.touched.clear();
    }

    /// Appends the report `seq` of `queues[rank]` to its identity's list.
    pub fn link(&mut self, queues: &mut [Queue], rank: usize, seq: u64) {
        let rep = queues[rank].get(seq).rep;
        let e = self.map.entry(rep.identity).or_insert_with(|| Entry {
            lists: Vec::new(),
            factor: rep.factor,
            touched: false,
        });
        if !e.touched {
            e.touched = true;
            self.touched.push(rep.identity);
        }
        match e.lists.binary_search_by_key(&(rank as u32), |l| l.rank) {
            Ok(k) => {
                let l = &mut e.lists[k];
                let tail = l.tail;
                l.tail = seq;
                l.len += 1;
                queues[rank].get_mut(tail).next = seq;
            }
            Err(k) => e.lists.insert(
                k,
                RankList {
                    rank: rank as u32,
                    len: 1,
                    head: seq,
                    tail: seq,
                },
            ),
        }
    }

    /// Links every live eligible report of `queues[rank]` in `[from, to)`.
    pub fn link_range(&mut self, queues: &mut [Queue], rank: usize, from: u64, to: u64) {
        for seq in from..to {
            let n = queues[rank].get(seq);
            if n.live && !n.rep.clear {
                self.link(queues, rank, seq);
            }
        }
    }

    /// Removes the first report of `identity`'s list on `rank` (the caller's
    /// report: queues are visited front to back); `next` is its next pointer.
    pub fn unlink_head(&mut self, identity: &Identity, rank: usize, next: u64) {
        let e = self
            .map
            .get_mut(identity)
            .expect("eligible reports are linked");
        let k = e
            .lists
            .binary_search_by_key(&(rank as u32), |l| l.rank)
            .expect("the rank has a list");
        let l = &mut e.lists[k];
        l.len -= 1;
        if l.len == 0 {
            e.lists.remove(k);
            if e.lists.is_empty() {
                self.map.remove(identity);
            }
        } else {
            l.head = next;
        }
    }
}
