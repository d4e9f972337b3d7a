//! Where the thread-per-core phases run their drivers: the readers on the shards pinned where
//! the disk's completions arrive, the compaction on the others.

/// Which shards run the readers and which the compaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) fg: Vec<usize>,
    pub(crate) bg: Vec<usize>,
}

impl Placement {
    /// The readers on the shards pinned where the disk's completions arrive (`near`), the
    /// compaction on the others; both on every shard in turn when `spread`, or when `near` is
    /// empty or holds every shard (no split to make).
    pub(crate) fn new(shards: usize, near: &[usize], spread: bool) -> Self {
        let all: Vec<usize> = (0..shards).collect();
        let rest: Vec<usize> = all.iter().copied().filter(|s| !near.contains(s)).collect();
        if spread || near.is_empty() || rest.is_empty() {
            return Placement {
                fg: all.clone(),
                bg: all,
            };
        }
        Placement {
            fg: near.to_vec(),
            bg: rest,
        }
    }

    /// How the start line says it.
    pub(crate) fn describe(&self) -> String {
        if self.fg == self.bg {
            format!("readers and compaction on shards {:?} in turn", self.fg)
        } else {
            format!(
                "readers on shards {:?} (pinned where the disk interrupts), compaction on {:?}",
                self.fg, self.bg
            )
        }
    }
}
