//! The cost model: what a read or a write costs in tokens of disk time ([`DiskModel`],
//! [`IoRequest`]).
//!
//! One token is one nanosecond of disk time ([`DiskModel::TOKENS_PER_SECOND`]). A request costs
//! `1/iops + bytes/bandwidth` of that time, each term rounded up to a whole token, so a disk kept
//! at `TOKENS_PER_SECOND` tokens per second ([`DiskModel::full_rate`]) is exactly saturated: many
//! small requests hit the IOPS limit, few large ones hit the bandwidth limit, and a mix is charged
//! for both, as in Seastar's I/O queue.

use std::fmt;
use std::ops::Range;

use crate::bucket::Rate;
use crate::BuildError;

/// Whether a request reads or writes (they cost differently).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoKind {
    /// A read.
    Read,
    /// A write.
    Write,
}

/// What a submitted request asks of the disk: a read or a write of some bytes, or a raw token
/// cost that bypasses the [`DiskModel`].
///
/// ```
/// use iothrottle::dispatcher::{DiskModel, Figures, IoRequest};
///
/// let disk = DiskModel::new(
///     Figures { iops: 100_000, bandwidth: 1_000_000_000 },
///     Figures { iops: 50_000, bandwidth: 500_000_000 },
/// );
/// // 1/100_000 s + 4096 B / (1 GB/s) = 10_000 ns + 4_096 ns of disk time.
/// assert_eq!(disk.cost(&IoRequest::read(4096)), 14_096);
/// assert_eq!(disk.cost(&IoRequest::tokens(7)), 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IoRequest {
    shape: Shape,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Shape {
    Io { kind: IoKind, bytes: u64 },
    Tokens(u64),
}

impl IoRequest {
    /// A read of `bytes`.
    pub const fn read(bytes: u64) -> Self {
        IoRequest {
            shape: Shape::Io {
                kind: IoKind::Read,
                bytes,
            },
        }
    }

    /// A write of `bytes`.
    pub const fn write(bytes: u64) -> Self {
        IoRequest {
            shape: Shape::Io {
                kind: IoKind::Write,
                bytes,
            },
        }
    }

    /// A read or a write of `bytes`.
    pub const fn new(kind: IoKind, bytes: u64) -> Self {
        IoRequest {
            shape: Shape::Io { kind, bytes },
        }
    }

    /// A request that costs exactly `tokens`, whatever the disk model (for work that is not a
    /// plain read or write). It has no bytes and cannot be split.
    pub const fn tokens(tokens: u64) -> Self {
        IoRequest {
            shape: Shape::Tokens(tokens),
        }
    }

    /// Read or write; `None` for a raw token cost.
    pub const fn kind(&self) -> Option<IoKind> {
        match self.shape {
            Shape::Io { kind, .. } => Some(kind),
            Shape::Tokens(_) => None,
        }
    }

    /// Bytes moved (0 for a raw token cost).
    pub const fn bytes(&self) -> u64 {
        match self.shape {
            Shape::Io { bytes, .. } => bytes,
            Shape::Tokens(_) => 0,
        }
    }
}

/// A disk's capacity: bandwidth and IOPS for reads and for writes. Turns requests into tokens
/// of disk time.
///
/// There is deliberately no `Default`: disks differ by orders of magnitude (a virtio disk, a SATA
/// SSD, an NVMe drive), and a guessed model silently over- or under-commits the real one. A model
/// is measured (e.g. `fio`, Seastar's `iotune`), loaded from an `io_properties.yaml`, or stated
/// explicitly with [`new`](Self::new) or [`symmetric`](Self::symmetric).
///
/// Invariant (checked by [`validate`](Self::validate) and by the dispatcher's builder): all four
/// figures are positive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DiskModel {
    /// What reads achieve.
    pub read: Figures,
    /// What writes achieve.
    pub write: Figures,
}

/// One direction of a [`DiskModel`] (reads or writes): its two figures, set by name, so that
/// they cannot be swapped silently.
///
/// ```
/// use iothrottle::dispatcher::{DiskModel, Figures};
///
/// let nvme = DiskModel::new(
///     Figures { iops: 400_000, bandwidth: 2_000_000_000 },
///     Figures { iops: 100_000, bandwidth: 1_000_000_000 },
/// );
/// assert_eq!(nvme.write.bandwidth, 1_000_000_000);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Figures {
    /// Operations per second at small sizes.
    pub iops: u64,
    /// Bytes per second at large sizes.
    pub bandwidth: u64,
}

impl DiskModel {
    /// Tokens per second of disk time: one token is one nanosecond.
    pub const TOKENS_PER_SECOND: u64 = 1_000_000_000;

    /// A disk model from what its reads and its writes achieve.
    pub const fn new(read: Figures, write: Figures) -> Self {
        DiskModel { read, write }
    }

    /// A disk that reads and writes alike: `figures` each way.
    pub const fn symmetric(figures: Figures) -> Self {
        DiskModel::new(figures, figures)
    }

    /// How long `request` keeps this disk busy, by the model (its cost in tokens, as time).
    pub fn disk_time(&self, request: &IoRequest) -> std::time::Duration {
        std::time::Duration::from_nanos(self.cost(request))
    }

    /// The rate that keeps this disk exactly busy: one second of disk time per second.
    pub const fn full_rate() -> Rate {
        Rate::per_second(Self::TOKENS_PER_SECOND)
    }

    /// Checks that all four figures are positive.
    pub fn validate(&self) -> Result<(), BuildError> {
        for (field, value) in [
            ("read.bandwidth", self.read.bandwidth),
            ("write.bandwidth", self.write.bandwidth),
            ("read.iops", self.read.iops),
            ("write.iops", self.write.iops),
        ] {
            if value == 0 {
                return Err(BuildError::ZeroDiskFigure { field });
            }
        }
        Ok(())
    }

    /// Tokens that `request` costs: `ceil(1e9/iops) + ceil(bytes × 1e9 / bandwidth)`.
    ///
    /// Saturates at `u64::MAX` (a request that large is rejected by the dispatcher anyway). A
    /// model with a zero figure costs `u64::MAX` for that kind of request.
    pub fn cost(&self, request: &IoRequest) -> u64 {
        match request.shape {
            Shape::Tokens(t) => t,
            Shape::Io { kind, bytes } => {
                let (bw, iops) = self.figures(kind);
                self.op_cost(iops)
                    .saturating_add(Self::bytes_cost(bytes, bw))
            }
        }
    }

    /// The largest number of bytes of `kind` whose cost stays within `max_tokens`, or `None`
    /// when even one byte costs more (the per-operation cost alone is above it).
    pub fn max_bytes_within(&self, kind: IoKind, max_tokens: u64) -> Option<u64> {
        let (bw, iops) = self.figures(kind);
        let op = self.op_cost(iops);
        if bw == 0 || op >= max_tokens {
            return None;
        }
        // ceil(b × 1e9 / bw) ≤ room  <=>  b × 1e9 ≤ room × bw  <=>  b ≤ floor(room × bw / 1e9).
        let room = (max_tokens - op) as u128;
        let b = room * bw as u128 / Self::TOKENS_PER_SECOND as u128;
        let b = u64::try_from(b).unwrap_or(u64::MAX);
        (b > 0).then_some(b)
    }

    /// The largest multiple of [`SPLIT_ALIGN`] bytes of `kind` whose cost stays within
    /// `max_tokens`, or `None` when not even one aligned block fits.
    pub fn max_aligned_bytes_within(&self, kind: IoKind, max_tokens: u64) -> Option<u64> {
        let b = self.max_bytes_within(kind, max_tokens)?;
        let aligned = b - b % SPLIT_ALIGN;
        (aligned > 0).then_some(aligned)
    }

    fn figures(&self, kind: IoKind) -> (u64, u64) {
        match kind {
            IoKind::Read => (self.read.bandwidth, self.read.iops),
            IoKind::Write => (self.write.bandwidth, self.write.iops),
        }
    }

    fn op_cost(&self, iops: u64) -> u64 {
        if iops == 0 {
            return u64::MAX;
        }
        Self::TOKENS_PER_SECOND.div_ceil(iops)
    }

    fn bytes_cost(bytes: u64, bw: u64) -> u64 {
        if bytes == 0 {
            return 0;
        }
        if bw == 0 {
            return u64::MAX;
        }
        // In 64 bits while the product fits (up to 18 GB a request): the 128-bit division is a
        // library call, the 64-bit one a single instruction, on every request's path.
        if let Some(p) = bytes.checked_mul(Self::TOKENS_PER_SECOND) {
            return p.div_ceil(bw);
        }
        let t = (bytes as u128 * Self::TOKENS_PER_SECOND as u128).div_ceil(bw as u128);
        u64::try_from(t).unwrap_or(u64::MAX)
    }
}

/// One piece of a split request: the byte range it covers within the original request.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Piece {
    /// Bytes from the start of the original request.
    pub range: Range<u64>,
    /// Which piece this is (0-based).
    pub index: usize,
}

impl Piece {
    /// Bytes in this piece.
    pub fn len(&self) -> u64 {
        self.range.end - self.range.start
    }

    /// `true` for an empty piece (only an empty request has one).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Debug for Piece {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Piece#{}({:?})", self.index, self.range)
    }
}

/// Split pieces start at multiples of this many bytes from the start of the request, and all but
/// the last are a multiple of it long: with an aligned offset and buffer, every piece can be
/// issued with `O_DIRECT` (which needs 512 B or 4 KiB alignment).
pub const SPLIT_ALIGN: u64 = 4096;

/// The most pieces one split request may have: each piece is a task and a handle, made at
/// submission, so the count a request's size asks for is checked before anything is allocated.
/// 65,536 pieces are 256 MiB in 4 KiB pieces, 8 GiB in 128 KiB ones.
pub const MAX_SPLIT_PIECES: u64 = 1 << 16;

/// Splits `bytes` into consecutive pieces of at most `max` bytes (`max` a positive multiple of
/// [`SPLIT_ALIGN`], or `u64::MAX` for one piece), as few as possible and of equal length rounded
/// up to [`SPLIT_ALIGN`] (the last one takes the rest). An empty request is one empty piece.
///
/// More than [`MAX_SPLIT_PIECES`] pieces is `Err` with the number of pieces it would take:
/// nothing is allocated for a count that comes from a caller's size.
pub(crate) fn split(bytes: u64, max: u64) -> Result<Vec<Piece>, u64> {
    debug_assert!(max == u64::MAX || (max > 0 && max.is_multiple_of(SPLIT_ALIGN)));
    if bytes == 0 {
        return Ok(vec![Piece {
            range: 0..0,
            index: 0,
        }]);
    }
    let n = bytes.div_ceil(max);
    if n > MAX_SPLIT_PIECES {
        return Err(n);
    }
    // ceil(bytes / n) <= max, and rounding up to the alignment stays <= max (a multiple of it).
    let size = if n == 1 {
        bytes
    } else {
        bytes.div_ceil(n).next_multiple_of(SPLIT_ALIGN)
    };
    let mut out = Vec::with_capacity(n as usize);
    let mut start = 0;
    while start < bytes {
        let end = start.saturating_add(size).min(bytes);
        out.push(Piece {
            range: start..end,
            index: out.len(),
        });
        start = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cost_is_op_plus_bytes() {
        let d = DiskModel::new(
            Figures {
                iops: 100_000,
                bandwidth: 1_000_000_000,
            },
            Figures {
                iops: 20_000,
                bandwidth: 250_000_000,
            },
        );
        assert_eq!(d.cost(&IoRequest::read(0)), 10_000);
        assert_eq!(d.cost(&IoRequest::read(1 << 20)), 10_000 + 1_048_576);
        assert_eq!(d.cost(&IoRequest::write(1 << 20)), 50_000 + 4 * 1_048_576);
        // Rounds up: 1 byte at 3 B/s is a third of a second, 333_333_333.3 ns.
        let slow = DiskModel::symmetric(Figures {
            iops: 1,
            bandwidth: 3,
        });
        assert_eq!(slow.cost(&IoRequest::read(1)), 1_000_000_000 + 333_333_334);
    }

    #[test]
    fn zero_figures_are_rejected() {
        let d = DiskModel::new(
            Figures {
                iops: 1,
                bandwidth: 1,
            },
            Figures {
                iops: 1,
                bandwidth: 0,
            },
        );
        assert!(matches!(
            d.validate(),
            Err(BuildError::ZeroDiskFigure {
                field: "write.bandwidth"
            })
        ));
        assert!(DiskModel::symmetric(Figures {
            iops: 1,
            bandwidth: 1
        })
        .validate()
        .is_ok());
    }

    #[test]
    fn max_bytes_within_none_when_op_alone_too_big() {
        let d = DiskModel::symmetric(Figures {
            iops: 1_000,
            bandwidth: 1_000_000_000,
        });
        // One operation costs 1_000_000 tokens.
        assert_eq!(d.max_bytes_within(IoKind::Read, 1_000_000), None);
        assert_eq!(d.max_bytes_within(IoKind::Read, 1_000_001), Some(1));
    }

    #[test]
    fn split_covers_the_request() {
        let p = split(10 << 12, 4 << 12).unwrap();
        let ranges: Vec<_> = p.iter().map(|p| p.range.clone()).collect();
        // Three pieces, as even as 4 KiB blocks allow.
        assert_eq!(
            ranges,
            vec![0..4 << 12, 4 << 12..8 << 12, 8 << 12..10 << 12]
        );
        let p = split(1 << 20, 400 << 10).unwrap();
        let lens: Vec<_> = p.iter().map(Piece::len).collect();
        assert_eq!(lens, vec![344 << 10, 344 << 10, 336 << 10]);
        assert_eq!(split(0, 4096).unwrap().len(), 1);
        assert_eq!(split(5000, u64::MAX).unwrap().len(), 1);
    }

    #[test]
    fn split_refuses_more_pieces_than_it_may_allocate() {
        assert_eq!(split(u64::MAX, 4096), Err(u64::MAX.div_ceil(4096)));
        let most = MAX_SPLIT_PIECES * 4096;
        assert_eq!(
            split(most, 4096).map(|p| p.len() as u64),
            Ok(MAX_SPLIT_PIECES)
        );
        assert_eq!(split(most + 1, 4096), Err(MAX_SPLIT_PIECES + 1));
        assert_eq!(split(u64::MAX, u64::MAX).map(|p| p.len()), Ok(1));
    }

    /// Pieces of `submit_split` start at 4 KiB multiples, not at the exact byte that fits the
    /// budget (e.g. 524_288_000 B/s × 500 µs = 262_144 + change), so they can be issued with
    /// O_DIRECT.
    #[test]
    fn split_pieces_are_4k_aligned_for_o_direct() {
        let d = DiskModel::symmetric(Figures {
            iops: 10_000,
            bandwidth: 300_000_000,
        });
        let max = d.max_aligned_bytes_within(IoKind::Write, 500_000).unwrap();
        assert_eq!(max % SPLIT_ALIGN, 0);
        assert!(!d
            .max_bytes_within(IoKind::Write, 500_000)
            .unwrap()
            .is_multiple_of(SPLIT_ALIGN));
        for p in split(1 << 20, max).unwrap() {
            assert_eq!(p.range.start % SPLIT_ALIGN, 0, "{p:?}");
            assert!(p.len() <= max);
            assert!(d.cost(&IoRequest::write(p.len())) <= 500_000);
        }
        // Not even one block fits: None, not a misaligned piece.
        assert_eq!(
            d.max_aligned_bytes_within(IoKind::Write, 100_000 + 13_000),
            None
        );
    }

    /// Where `bytes × 10⁹` leaves 64 bits.
    const WIDE: u64 = u64::MAX / DiskModel::TOKENS_PER_SECOND;

    proptest! {
        /// The byte cost's 64-bit path agrees with the 128-bit formula, on both sides of where
        /// the product leaves 64 bits.
        #[test]
        fn bytes_cost_matches_the_128_bit_formula(
            bytes in prop_oneof![0u64..=u64::MAX, WIDE - 1_000..=WIDE + 1_000],
            bw in prop_oneof![1u64..=u64::MAX, 1u64..10_000_000_000],
        ) {
            let wide = (bytes as u128 * DiskModel::TOKENS_PER_SECOND as u128).div_ceil(bw as u128);
            let want = if bytes == 0 { 0 } else { u64::try_from(wide).unwrap_or(u64::MAX) };
            prop_assert_eq!(DiskModel::bytes_cost(bytes, bw), want);
        }

        /// The largest size within a budget fits it, and one byte more does not.
        #[test]
        fn max_bytes_within_is_tight(
            bw in 1u64..10_000_000_000,
            iops in 1u64..2_000_000,
            max in 1u64..100_000_000_000,
        ) {
            let d = DiskModel::symmetric(Figures { iops, bandwidth: bw });
            match d.max_bytes_within(IoKind::Write, max) {
                Some(b) => {
                    prop_assert!(d.cost(&IoRequest::write(b)) <= max);
                    prop_assert!(d.cost(&IoRequest::write(b + 1)) > max);
                }
                None => prop_assert!(d.cost(&IoRequest::write(1)) > max),
            }
        }

        /// Pieces are consecutive, non-empty, at most `max`, 4 KiB-aligned (start, and length
        /// of all but the last), as few as `max` allows, and cover the request exactly.
        #[test]
        fn split_is_exact_and_aligned(bytes in 1u64..100_000_000, blocks in 1u64..200) {
            let max = blocks * SPLIT_ALIGN;
            let pieces = split(bytes, max).unwrap();
            prop_assert_eq!(pieces.len() as u64, bytes.div_ceil(max));
            let mut at = 0;
            for (i, p) in pieces.iter().enumerate() {
                prop_assert_eq!(p.index, i);
                prop_assert_eq!(p.range.start, at);
                prop_assert_eq!(p.range.start % SPLIT_ALIGN, 0);
                prop_assert!(!p.is_empty() && p.len() <= max);
                if i + 1 < pieces.len() {
                    prop_assert_eq!(p.len() % SPLIT_ALIGN, 0);
                }
                at = p.range.end;
            }
            prop_assert_eq!(at, bytes);
        }
    }
}
