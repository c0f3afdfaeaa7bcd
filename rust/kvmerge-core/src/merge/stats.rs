/// Counters since the merger was made. Always
/// `reports == consumed + cleared + expired + pending`: a publication the
/// guard withholds consumed its reports all the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub steps: u64,
    pub batches: u64,
    pub reports: u64,
    /// Events output (after the guard, when there is one).
    pub published: u64,
    pub consumed: u64,
    pub cleared: u64,
    pub expired: u64,
    pub pending: u64,
    /// Publications the guard withheld, by why: a store whose parent is not
    /// held, a store of a block held already (or twice in it), a removal of
    /// a block not held (or twice in it).
    pub withheld_orphan: u64,
    pub withheld_duplicate: u64,
    pub withheld_unknown: u64,
}

impl Stats {
    /// Publications the guard withheld, whatever the reason.
    pub fn withheld(&self) -> u64 {
        self.withheld_orphan + self.withheld_duplicate + self.withheld_unknown
    }
}
