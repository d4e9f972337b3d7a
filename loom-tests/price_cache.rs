//! The per-process price cache of the replenish: a reader never takes a torn or foreign price
//! (against two writers, one of them stopped for ever halfway), and a replenish that prices
//! from a warm cache, or finds the cache holding the current regime across an unclosed rate
//! change, counts exactly what the rate record would.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::bucket::price::{Price, PriceCache};
use crate::{Rate, Uncapped};

use super::common::{at, check_bounds, replenish_at, restored};

fn price(tokens: u64, period_ns: u64, epoch: u64) -> Price {
    let raw = Rate::new(tokens, Duration::from_nanos(period_ns))
        .raw()
        .unwrap();
    Price::new(raw, epoch)
}

#[test]
fn a_reader_never_takes_a_torn_or_foreign_price() {
    loom::model(|| {
        // Every field differs between the three, so a mix of two would show.
        let p = [price(7, 3, 10), price(5, 2, 20), price(11, 13, 30)];
        let cache = Arc::new(PriceCache::new());
        cache.put(1, p[0]);
        let w2 = {
            let cache = cache.clone();
            thread::spawn(move || cache.put_stopping(2, p[1], false))
        };
        // Stops for ever after half its words if it gets to write at all.
        let w3 = {
            let cache = cache.clone();
            thread::spawn(move || cache.put_stopping(3, p[2], true))
        };
        for (ticket, want) in [(1, p[0]), (2, p[1]), (3, p[2]), (1, p[0])] {
            if let Some(got) = cache.get(ticket) {
                assert_eq!(got, want, "ticket {ticket}");
            }
        }
        let stored2 = w2.join().unwrap();
        assert!(!w3.join().unwrap());
        // Afterwards: the last whole price, or nothing if the stopped writer got in.
        let (g1, g2) = (cache.get(1), cache.get(2));
        assert!(g1.is_none() || g1 == Some(p[0]));
        assert!(g2.is_none() || (stored2 && g2 == Some(p[1])));
        assert_eq!(cache.get(3), None);
    });
}

/// 7 per 3 ns.
fn old() -> Rate {
    Rate::new(7, Duration::from_nanos(3))
}

/// 5 per 2 ns.
fn new() -> Rate {
    Rate::new(5, Duration::from_nanos(2))
}

fn c_old(ns: u64) -> u64 {
    7 * ns / 3
}

/// The new rate from its epoch at 10 ns.
fn c_new(ns: u64) -> u64 {
    5 * (ns - 10) / 2
}

#[test]
fn a_warm_cache_prices_as_the_record_against_a_rate_change() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        // Warms the cache with the old rate.
        let w = replenish_at(&*b, 3);
        assert_eq!(w, c_old(3));
        let setter = {
            let b = b.clone();
            thread::spawn(move || {
                let added = b.loom_set_rate_at(new(), Duration::from_nanos(10));
                check_bounds(&*b);
                added
            })
        };
        let r = replenish_at(&*b, 16);
        let s = setter.join().unwrap();
        // As without a cache: the change closed [3, 10) at the old rate and the replenish
        // priced [10, 16) at the new one, or lost its CAS; or the replenish came first and
        // counted [3, 16) at the old rate (from the cache) or across the change.
        let ok = [
            (c_old(10) - w, c_new(16)),
            (c_old(10) - w, 0),
            (0, c_old(16) - w),
            (0, c_old(10) - w + c_new(16)),
        ];
        assert!(ok.contains(&(s, r)), "set_rate added {s}, replenish {r}");
        let f = replenish_at(&*b, 19);
        let change_at = if r == c_old(16) - w { 16 } else { 10 };
        let total = c_old(change_at) + c_new(19) - c_new(change_at);
        assert_eq!(w + s + r + f, total, "{w} + {s} + {r} + {f}");
        assert_eq!(b.snapshot().head, at(total));
    });
}

#[test]
fn a_cache_of_a_regime_whose_change_is_not_closed_is_not_taken_for_the_whole_interval() {
    loom::model(|| {
        let b = Arc::new(restored::<Uncapped>(old(), 1_000, 1, 0, None));
        // A change at 10 published and never closed (its writer stopped): `last` stays at 0,
        // before the new regime's epoch.
        assert_eq!(
            b.loom_set_rate_stopping_at(new(), Duration::from_nanos(10), 13),
            None
        );
        // The first replenish to price caches the new regime; one that then finds it cached
        // while `last` is still 0 (the first lost its CAS, or has not made it) must price
        // [0, 10) at the old rate, not all of it at the new one.
        let r = {
            let b = b.clone();
            thread::spawn(move || replenish_at(&*b, 12))
        };
        let a14 = replenish_at(&*b, 14);
        let a12 = r.join().unwrap();
        let f = replenish_at(&*b, 16);
        let total = c_old(10) + c_new(16);
        assert_eq!(a12 + a14 + f, total, "{a12} + {a14} + {f}");
        assert_eq!(b.snapshot().head, at(total));
    });
}
