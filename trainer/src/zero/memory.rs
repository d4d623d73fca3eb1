//! Per-rank memory accounting: every buffer the engine and the model allocate is
//! recorded here by category, so a rank can say what it holds (and held at peak).

use serde::{Deserialize, Serialize};

/// What a buffer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// Compute-precision parameters: full working copies and shards.
    Params,
    /// Parameter gradients: full accumulation buffers and reduced shards.
    Grads,
    /// fp32 master weights and AdamW moments.
    Optimizer,
    /// Saved forward activations and their backward scratch.
    Activations,
    /// Staging buffers for collectives.
    Comm,
    /// Everything else (token ids, loss buffers).
    Workspace,
    /// Idle working buffers the engine keeps for reuse (stage 3 gathered parameters,
    /// stage 2/3 full gradients), so the steady-state step allocates nothing — like
    /// PyTorch's reserved-but-unallocated memory, and counted just as honestly.
    Cached,
}

/// Bytes per category, now and at the peak of the total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBytes {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub comm: u64,
    pub workspace: u64,
    pub cached: u64,
}

impl MemoryBytes {
    /// Every category with its name, in display order (tables, summaries).
    pub fn categories(&self) -> [(&'static str, u64); 7] {
        [
            ("params", self.params),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("comm", self.comm),
            ("workspace", self.workspace),
            ("cached", self.cached),
        ]
    }
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations + self.comm + self.workspace + self.cached
    }
    fn slot(&mut self, c: Category) -> &mut u64 {
        match c {
            Category::Params => &mut self.params,
            Category::Grads => &mut self.grads,
            Category::Optimizer => &mut self.optimizer,
            Category::Activations => &mut self.activations,
            Category::Comm => &mut self.comm,
            Category::Workspace => &mut self.workspace,
            Category::Cached => &mut self.cached,
        }
    }
}

/// A rank's host memory for offload and asynchronous checkpoints, by category: allocated at
/// start-up and held for the whole run (so there is no separate peak).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// fp32 master weights and AdamW moments of the host optimizer (pageable).
    pub optimizer: u64,
    /// `offload.params`: the rounded parameter shard (page-locked).
    pub params: u64,
    /// Page-locked staging for gradients going to the host and parameters coming back: the
    /// rings, or with `offload.delayed_update` every unit's own pair of buffers.
    pub staging: u64,
    /// `checkpoint.async`: the page-locked copy of this rank's checkpoint shard (fp32 master
    /// weights, AdamW m and v of its range of every unit) that the background writer reads.
    #[serde(default)]
    pub checkpoint: u64,
}

impl HostMemory {
    pub fn total(&self) -> u64 {
        self.optimizer + self.params + self.staging + self.checkpoint
    }
    /// The page-locked part (what `ulimit -l` must allow).
    pub fn pinned(&self) -> u64 {
        self.params + self.staging + self.checkpoint
    }
}

/// A rank's memory report: the current bytes and the snapshot at the highest total seen,
/// on the device; and what the rank holds in host memory for offload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    pub current: MemoryBytes,
    pub peak: MemoryBytes,
    pub peak_total: u64,
    #[serde(default)]
    pub host: HostMemory,
}

/// Running ledger of allocations.
#[derive(Debug, Default, Clone)]
pub struct MemoryLedger {
    report: MemoryReport,
}

impl MemoryLedger {
    pub fn alloc(&mut self, c: Category, bytes: usize) {
        *self.report.current.slot(c) += bytes as u64;
        let total = self.report.current.total();
        if total > self.report.peak_total {
            self.report.peak_total = total;
            self.report.peak = self.report.current;
        }
    }
    pub fn free(&mut self, c: Category, bytes: usize) {
        let s = self.report.current.slot(c);
        *s = s.saturating_sub(bytes as u64);
    }
    /// Move `bytes` from one category to another (e.g. a buffer parked in the pool).
    pub fn reassign(&mut self, from: Category, to: Category, bytes: usize) {
        self.free(from, bytes);
        self.alloc(to, bytes);
    }
    pub fn report(&self) -> MemoryReport {
        self.report
    }
    /// Set the host part of the report.
    pub fn set_host(&mut self, host: HostMemory) {
        self.report.host = host;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn peak_tracks_highest_total() {
        let mut l = MemoryLedger::default();
        l.alloc(Category::Params, 100);
        l.alloc(Category::Grads, 50);
        l.free(Category::Grads, 50);
        l.alloc(Category::Activations, 20);
        let r = l.report();
        assert_eq!(r.current.total(), 120);
        assert_eq!(r.peak_total, 150);
        assert_eq!(r.peak.grads, 50);
    }
}
