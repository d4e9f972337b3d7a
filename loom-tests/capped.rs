//! Capped mode: `release` and `refund` (which advance `ceil`) racing with a replenish; `head`
//! never passes `ceil` nor `tail + limit`.

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::{Capped, Rate};

use super::common::{ahead, at, check_bounds, replenish_at, restored};

#[test]
fn release_and_refund_vs_replenish_never_pass_ceil() {
    loom::model(|| {
        // Empty bucket, limit 10, but ceil only 2 ahead of head: completions gate the fill.
        let b = Arc::new(restored::<Capped>(
            Rate::new(1, Duration::from_nanos(1)),
            10,
            1,
            0,
            Some(2),
        ));
        let releaser = {
            let b = b.clone();
            thread::spawn(move || {
                b.release(3);
                check_bounds(&*b);
            })
        };
        let refunder = {
            let b = b.clone();
            thread::spawn(move || {
                let r = b.refund(1);
                check_bounds(&*b);
                r
            })
        };
        // 8 tokens earned; at most ceil - head of them fit.
        let replenished = replenish_at(&*b, 8);
        check_bounds(&*b);
        releaser.join().unwrap();
        let refunded = refunder.join().unwrap();
        let s = b.snapshot();
        assert_eq!(s.ceil, Some(at(2 + 3 + 1)));
        assert_eq!(
            s.head,
            at(refunded + replenished),
            "head moved by what was reported"
        );
        assert!(ahead(s.head, at(6)) <= 0);
        assert!(refunded <= 1 && replenished <= 8);
        // The ceil was at least START + 2 throughout and the refund moves ceil before head.
        assert!(refunded + replenished >= 2, "{refunded} + {replenished}");
        assert_eq!(b.last_replenish(), Some(Duration::from_nanos(8)));
    });
}

#[test]
fn release_vs_replenish_fills_to_the_ceil_seen() {
    loom::model(|| {
        let b = Arc::new(restored::<Capped>(
            Rate::new(1, Duration::from_nanos(1)),
            10,
            1,
            0,
            Some(2),
        ));
        let releaser = {
            let b = b.clone();
            thread::spawn(move || {
                b.release(3);
                check_bounds(&*b);
            })
        };
        let replenisher = {
            let b = b.clone();
            thread::spawn(move || {
                let added = replenish_at(&*b, 8);
                check_bounds(&*b);
                added
            })
        };
        releaser.join().unwrap();
        let added = replenisher.join().unwrap();
        // The replenish saw ceil before or after the release: 2 or 5 tokens, nothing else.
        assert!(added == 2 || added == 5, "{added}");
        assert_eq!(b.snapshot().head, at(added));
    });
}
