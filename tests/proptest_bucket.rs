//! Property tests: the real bucket against a simple sequential model in unbounded integers.
//!
//! The model keeps `tail`, `head` and `ceil` as `i128` offsets from where the bucket started
//! (no wrapping), the epoch the current rate counts from, the threshold, the limit cap and the
//! first-replenish fill. A rate change closes the old rate's interval (adding its tokens
//! whatever the threshold) and starts a new epoch. The bucket starts anywhere, including a few tokens before
//! `u64::MAX`, so its rovers wrap during the run; the model's positions are compared modulo
//! 2^64 after every operation.

use std::time::Duration;

use proptest::prelude::*;

use iothrottle::{
    BucketConfig, BucketState, Capped, Clock, ManualClock, Mode, Rate, SharedTokenBucket, Uncapped,
};

/// Timestamps stop here (2^63 - 2 ns, about 292 years): see `SharedTokenBucket::replenish`.
const MAX_TIMESTAMP: u128 = (1u128 << 63) - 2;
/// Claims and completions are kept this close to `head` (the documented wrap rule is 2^62).
const MAX_SPREAD: i128 = 1 << 61;

/// The sequential model: what the bucket must do, in unbounded integers.
#[derive(Debug, Clone)]
struct Model {
    tail: i128,
    head: i128,
    ceil: Option<i128>,
    limit: u64,
    threshold: u64,
    tokens: u64,
    period_ns: u64,
    /// Where the current rate's count starts.
    epoch: u128,
    /// `None` before the first replenish.
    last: Option<u128>,
    /// The clock, in nanoseconds (saturating like `ManualClock`).
    now: u128,
}

impl Model {
    fn fill(&mut self, extra: u128) -> u64 {
        let mut cap = self.tail + self.limit as i128;
        if let Some(ceil) = self.ceil {
            cap = cap.min(ceil);
        }
        let room = cap - self.head;
        if room <= 0 {
            return 0;
        }
        let add = extra.min(room as u128) as i128;
        self.head += add;
        add as u64
    }

    /// `floor(rate × (t − epoch))`.
    fn count(&self, t: u128) -> u128 {
        assert!(t >= self.epoch, "the model never counts before its epoch");
        self.tokens as u128 * (t - self.epoch) / self.period_ns as u128
    }

    fn replenish(&mut self) -> u64 {
        let now = self.now.min(MAX_TIMESTAMP);
        let Some(last) = self.last else {
            // The first replenish fills the bucket.
            self.last = Some(now);
            return self.fill(self.limit as u128);
        };
        if now <= last {
            return 0;
        }
        let extra = self.count(now) - self.count(last);
        if extra < self.threshold as u128 {
            // Nothing happens: the time keeps accruing.
            return 0;
        }
        self.last = Some(now);
        self.fill(extra)
    }

    /// The old rate's interval is closed (its tokens added whatever the threshold), and the
    /// new rate counts from now.
    fn set_rate(&mut self, rate: Rate) -> u64 {
        let now = self.now.min(MAX_TIMESTAMP);
        let mut added = 0;
        if let Some(last) = self.last {
            if now > last {
                let extra = self.count(now) - self.count(last);
                added = self.fill(extra);
                self.last = Some(now);
            }
        }
        self.tokens = rate.tokens();
        self.period_ns = rate.period().as_nanos() as u64;
        self.epoch = now;
        added
    }

    fn refund(&mut self, n: u64) -> u64 {
        if let Some(ceil) = &mut self.ceil {
            *ceil += n as i128;
        }
        self.fill(n as u128)
    }

    fn available(&self) -> u64 {
        (self.head - self.tail).clamp(0, self.limit as i128) as u64
    }

    fn duration_for(&self, n: u64) -> Duration {
        let ns = (n as u128 * self.period_ns as u128).div_ceil(self.tokens as u128);
        Duration::new((ns / 1_000_000_000) as u64, (ns % 1_000_000_000) as u32)
    }
}

/// One step of a run. Amounts are seeds, scaled to the bucket's limit by the runner.
#[derive(Debug, Clone)]
enum Op {
    Grab(Amount),
    Refund(Amount),
    Release(Amount),
    Advance(u64),
    Replenish,
    SetRate(Rate),
    /// `deficiency` at `tail - offset`, `available`, `duration_for`.
    Check(i64, u64),
}

#[derive(Debug, Clone, Copy)]
enum Amount {
    Small(u64),
    /// A fraction of the limit, in parts per million (up to 3× the limit).
    OfLimit(u32),
}

impl Amount {
    fn tokens(self, limit: u64) -> u64 {
        match self {
            Amount::Small(n) => n,
            Amount::OfLimit(ppm) => (limit as u128 * ppm as u128 / 1_000_000) as u64,
        }
    }
}

fn amount() -> impl Strategy<Value = Amount> {
    prop_oneof![
        (0u64..=4).prop_map(Amount::Small),
        (0u32..=3_000_000).prop_map(Amount::OfLimit),
    ]
}

/// Clock steps: none, nanoseconds, up to a second, up to an hour, years, and "forever".
fn step() -> impl Strategy<Value = u64> {
    prop_oneof![
        2 => Just(0u64),
        3 => 1u64..=1_000,
        3 => 1u64..=1_000_000_000,
        2 => 1u64..=3_600_000_000_000,
        1 => 1_000_000_000_000_000u64..=4_000_000_000_000_000_000,
        1 => Just(u64::MAX),
    ]
}

/// The extreme rates (7 per 3 s, 10^12/s, 1 per hour) and random valid ones.
fn rate() -> impl Strategy<Value = Rate> {
    prop_oneof![
        Just(Rate::new(7, Duration::from_secs(3))),
        Just(Rate::per_second(1_000_000_000_000)),
        Just(Rate::new(1, Duration::from_secs(3600))),
        (1u64..=1_000_000_000, 1u64..=10_000_000_000_000)
            .prop_map(|(t, p)| Rate::new(t, Duration::from_nanos(p)))
            .prop_filter("valid rate", |r| r.validate().is_ok()),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => amount().prop_map(Op::Grab),
        2 => amount().prop_map(Op::Refund),
        2 => amount().prop_map(Op::Release),
        4 => step().prop_map(Op::Advance),
        4 => Just(Op::Replenish),
        1 => rate().prop_map(Op::SetRate),
        2 => (-8i64..=8, 0u64..=1_000_000).prop_map(|(o, n)| Op::Check(o, n)),
    ]
}

/// Where and how the bucket starts.
#[derive(Debug, Clone)]
struct Setup {
    rate: Rate,
    limit: u64,
    /// Threshold = 1 + seed % limit, or 1.
    threshold_seed: Option<u64>,
    /// `None`: a new bucket at 0 (empty, first replenish fills). `Some`: restored state.
    restored: Option<Restored>,
    /// Clock time when the bucket is made.
    clock_start: u64,
}

#[derive(Debug, Clone)]
struct Restored {
    /// How far before `u64::MAX` the tail starts.
    tail_before_max: u64,
    /// Tokens in the bucket (fraction of the limit, ppm), or owed when `owed`.
    tokens_ppm: u32,
    owed: bool,
    /// Capped: `ceil - head`, in ppm of the limit.
    ceil_ppm: u32,
}

fn setup() -> impl Strategy<Value = Setup> {
    let limit = prop_oneof![
        1u64..=10,
        1u64..=10_000,
        1u64..=(1 << 40),
        Just(BucketConfig::MAX_LIMIT),
    ];
    let restored = prop_oneof![
        1 => Just(None),
        3 => (0u64..=8, 0u32..=1_000_000, any::<bool>(), 0u32..=1_000_000).prop_map(
            |(tail_before_max, tokens_ppm, owed, ceil_ppm)| Some(Restored {
                tail_before_max,
                tokens_ppm,
                owed,
                ceil_ppm,
            })
        ),
    ];
    (
        rate(),
        limit,
        prop_oneof![Just(None), any::<u64>().prop_map(Some)],
        restored,
        prop_oneof![Just(0u64), any::<u64>().prop_map(|t| t >> 2)],
    )
        .prop_map(
            |(rate, limit, threshold_seed, restored, clock_start)| Setup {
                rate,
                limit,
                threshold_seed,
                restored,
                clock_start,
            },
        )
}

/// Builds the bucket and its model.
fn build<M: Mode>(setup: &Setup) -> (SharedTokenBucket<M, ManualClock>, ManualClock, Model, u64) {
    let limit = setup.limit;
    let threshold = setup.threshold_seed.map_or(1, |s| 1 + s % limit);
    let cfg = BucketConfig::new(setup.rate, limit).with_threshold(threshold);
    let clock = ManualClock::new();
    clock.advance(Duration::from_nanos(setup.clock_start));
    let now = setup.clock_start as u128;
    let period_ns = u64::try_from(setup.rate.period().as_nanos()).unwrap();
    let mut model = Model {
        tail: 0,
        head: 0,
        ceil: M::CAPPED.then_some(limit as i128),
        limit,
        threshold,
        tokens: setup.rate.tokens(),
        period_ns,
        epoch: now.min(MAX_TIMESTAMP),
        last: None,
        now,
    };
    let (bucket, origin) = match &setup.restored {
        None => (
            SharedTokenBucket::with_clock(cfg, clock.clone()).unwrap(),
            0,
        ),
        Some(r) => {
            let tail = u64::MAX - r.tail_before_max;
            // A deficit must stay below 2^62 (`from_state` refuses it otherwise).
            let ppm = if r.owed {
                r.tokens_ppm.min(999_999)
            } else {
                r.tokens_ppm
            };
            let tokens = (limit as u128 * ppm as u128 / 1_000_000) as i128;
            let tokens = if r.owed { -tokens } else { tokens };
            let head = tail.wrapping_add(tokens as i64 as u64);
            let ceil_ahead = (limit as u128 * r.ceil_ppm as u128 / 1_000_000) as i128;
            model.head = tokens;
            model.ceil = M::CAPPED.then_some(tokens + ceil_ahead);
            model.last = Some(now.min(MAX_TIMESTAMP));
            let state = BucketState {
                tail,
                head,
                ceil: M::CAPPED.then_some(head.wrapping_add(ceil_ahead as u64)),
            };
            (
                SharedTokenBucket::from_state(cfg, clock.clone(), state).unwrap(),
                tail,
            )
        }
    };
    (bucket, clock, model, origin)
}

/// `origin + x`, modulo 2^64.
fn pos(origin: u64, x: i128) -> u64 {
    origin.wrapping_add(x as u64)
}

/// `release` of a capped bucket (absent on an uncapped one).
type ReleaseFn<M> = fn(&SharedTokenBucket<M, ManualClock>, u64);

/// Runs `ops` on a real bucket and on the model, comparing everything after every step.
/// `release` is `Some` for a capped bucket.
fn run<M: Mode>(
    setup: &Setup,
    ops: &[Op],
    release: Option<ReleaseFn<M>>,
) -> Result<(), TestCaseError> {
    let (b, clock, mut m, origin) = build::<M>(setup);
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Grab(a) => {
                let n = a.tokens(m.limit);
                if m.tail + n as i128 - m.head >= MAX_SPREAD {
                    continue;
                }
                m.tail += n as i128;
                prop_assert_eq!(b.grab(n), pos(origin, m.tail), "grab {} at step {}", n, i);
            }
            Op::Refund(a) => {
                let n = a.tokens(m.limit);
                if m.ceil.is_some_and(|c| c + n as i128 - m.head >= MAX_SPREAD) {
                    continue;
                }
                let want = m.refund(n);
                prop_assert_eq!(b.refund(n), want, "refund {} at step {}", n, i);
            }
            Op::Release(a) => {
                let (Some(release), Some(ceil)) = (release, &mut m.ceil) else {
                    continue;
                };
                let n = a.tokens(m.limit);
                if *ceil + n as i128 - m.head >= MAX_SPREAD {
                    continue;
                }
                *ceil += n as i128;
                release(&b, n);
            }
            Op::Advance(ns) => {
                clock.advance(Duration::from_nanos(ns));
                m.now = (m.now + ns as u128).min(u64::MAX as u128);
                prop_assert_eq!(clock.now().as_nanos(), m.now);
            }
            Op::Replenish => {
                let want = m.replenish();
                prop_assert_eq!(b.replenish(), want, "replenish at step {}: {:?}", i, m);
            }
            Op::SetRate(rate) => {
                let head = m.head;
                m.set_rate(rate);
                b.set_rate(rate).unwrap();
                prop_assert!(m.head >= head);
            }
            Op::Check(offset, n) => {
                let at = m.tail - offset as i128;
                prop_assert_eq!(
                    b.deficiency(pos(origin, at)),
                    (at - m.head).max(0) as u64,
                    "deficiency at step {}",
                    i
                );
                prop_assert_eq!(b.duration_for(n), m.duration_for(n));
            }
        }
        // The state after every step.
        let s = b.snapshot();
        prop_assert_eq!(s.tail, pos(origin, m.tail), "tail after step {}", i);
        prop_assert_eq!(s.head, pos(origin, m.head), "head after step {}", i);
        prop_assert_eq!(
            s.ceil,
            m.ceil.map(|c| pos(origin, c)),
            "ceil after step {}",
            i
        );
        prop_assert!(
            m.head <= m.tail + m.limit as i128,
            "model broke head ≤ tail + limit"
        );
        if let Some(ceil) = m.ceil {
            prop_assert!(m.head <= ceil, "model broke head ≤ ceil");
        }
        prop_assert_eq!(b.available(), m.available());
        prop_assert_eq!(b.deficiency(s.tail), (m.tail - m.head).max(0) as u64);
        prop_assert_eq!(
            b.last_replenish(),
            m.last.map(|l| Duration::from_nanos(l as u64))
        );
        prop_assert_eq!(b.rate().tokens(), m.tokens);
        prop_assert_eq!(b.rate().period(), Duration::from_nanos(m.period_ns));
    }
    Ok(())
}

fn release_capped(b: &SharedTokenBucket<Capped, ManualClock>, n: u64) {
    b.release(n);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    /// Uncapped bucket vs the model.
    #[test]
    fn uncapped_matches_model(setup in setup(), ops in prop::collection::vec(op(), 1..64)) {
        run::<Uncapped>(&setup, &ops, None)?;
    }

    /// Capped bucket (with `release`) vs the model.
    #[test]
    fn capped_matches_model(setup in setup(), ops in prop::collection::vec(op(), 1..64)) {
        run::<Capped>(&setup, &ops, Some(release_capped))?;
    }

    /// No rounding drift, across rate changes: on an empty bucket that never caps, the tokens
    /// issued by any sequence of replenishes and rate changes are exactly the sum, over the
    /// pieces between rate changes, of `floor(rate × piece)`, up to the last replenish, and
    /// what is not issued yet is below the threshold. Rovers start anywhere, including just
    /// before `u64::MAX` (they wrap).
    #[test]
    fn tokens_issued_are_piecewise_floor_of_rate_times_elapsed(
        first in rate(),
        threshold in prop_oneof![Just(1u64), 1u64..=1_000],
        clock_start in prop_oneof![Just(0u64), 0u64..=(1 << 62)],
        tail in prop_oneof![Just(0u64), (0u64..=16).prop_map(|k| u64::MAX - k)],
        steps in prop::collection::vec(
            (
                prop_oneof![Just(0u64), 1u64..=1_000, 1u64..=1_000_000_000, 1u64..=1_000_000_000_000],
                prop_oneof![6 => Just(None), 1 => rate().prop_map(Some)],
            ),
            1..100,
        ),
    ) {
        let cfg = BucketConfig::new(first, BucketConfig::MAX_LIMIT).with_threshold(threshold);
        let clock = ManualClock::new();
        clock.advance(Duration::from_nanos(clock_start));
        let state = BucketState { tail, head: tail, ceil: None };
        let b = SharedTokenBucket::<Uncapped, _>::from_state(cfg, clock.clone(), state).unwrap();
        let floor = |rate: Rate, elapsed: u128| {
            rate.tokens() as u128 * elapsed / rate.period().as_nanos()
        };
        // Tokens of the closed pieces, and the open piece's rate and start.
        let (mut closed, mut rate, mut start): (u128, Rate, u128) = (0, first, 0);
        let mut issued: u128 = 0;
        let mut elapsed: u128 = 0;
        let mut take = |b: &SharedTokenBucket<Uncapped, ManualClock>| {
            // Keep the bucket empty: nothing is ever capped.
            let n = b.available();
            let t = b.grab(n);
            assert_eq!(b.deficiency(t), 0);
            issued += n as u128;
            issued
        };
        for (ns, change) in steps {
            clock.advance(Duration::from_nanos(ns));
            elapsed += ns as u128;
            b.replenish();
            if let Some(new) = change {
                b.set_rate(new).unwrap();
                closed += floor(rate, elapsed - start);
                (rate, start) = (new, elapsed);
            }
            let issued = take(&b);
            prop_assert_eq!(b.available(), 0);
            let last = b.last_replenish().unwrap().as_nanos() - clock_start as u128;
            prop_assert_eq!(
                issued,
                closed + floor(rate, last - start),
                "issued vs the pieces' floors up to the last replenish"
            );
            prop_assert!(closed + floor(rate, elapsed - start) - issued < threshold as u128);
        }
    }
}
