/// Counters since the merger was made. Always
/// `reports == consumed + cleared + expired + pending`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub steps: u64,
    pub batches: u64,
    pub reports: u64,
    pub published: u64,
    pub consumed: u64,
    pub cleared: u64,
    pub expired: u64,
    pub pending: u64,
}
