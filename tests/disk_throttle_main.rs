//! The main job's (`examples/disk_throttle`) flags and its open-loop arithmetic, compiled from
//! the example's own modules.
#![cfg(feature = "rt")] // the example needs the tokio layers

use std::time::{Duration, Instant};

use clap::Parser;

#[path = "../examples/disk_throttle/args.rs"]
#[allow(dead_code)] // the example uses every item; this test a few
mod args;
#[path = "../examples/disk_throttle/open_loop.rs"]
mod open_loop;
#[path = "../examples/disk_throttle/placement.rs"]
#[allow(dead_code)] // `describe` is the example's
mod placement;

#[path = "../examples/disk_throttle/stall.rs"]
#[allow(dead_code)] // the constants are the report's
mod stall;

use args::{check_values, Args};
use open_loop::{median, Rounds, Schedule};
use placement::Placement;
use stall::StallWatch;

fn parse(flags: &[&str]) -> Result<Args, clap::Error> {
    Args::try_parse_from(std::iter::once("disk_throttle").chain(flags.iter().copied()))
}

#[test]
fn the_defaults_leave_the_dispatcher_to_the_builder() {
    let a = parse(&[]).unwrap();
    assert_eq!(a.goal_us, None, "the builder's default goal");
    assert_eq!(a.shards, None, "the builder's default shards");
    assert_eq!(a.bg_in_flight_us, None, "a background class's bound");
    assert!(!a.saturate && !a.no_bg_bound && !a.uncapped && !a.spread);
    assert_eq!(a.rounds, 6);
    assert_eq!(parse(&["--rounds", "3"]).unwrap().rounds, 3);
    assert_eq!(
        (a.fg_iops, a.fg_depth, a.bg_kib, a.bg_depth),
        (2000, 4, 1024, 4)
    );
    assert_eq!(a.plain_rate, 50_000_000);
    assert!(!a.stall_watch, "the watch runs only when asked for");
    check_values(&a).unwrap();
}

#[test]
fn saturate_and_the_short_run_flags_parse() {
    let a = parse(&[
        "--saturate",
        "--stall-watch",
        "--phase-secs",
        "1",
        "--slice-ms",
        "200",
        "--goal-us",
        "300",
        "--shards",
        "2",
        "--plain-rate",
        "20MiB/s",
        "--shares",
        "800:200",
    ])
    .unwrap();
    assert!(a.saturate && a.stall_watch);
    assert_eq!(
        (a.rounds, a.slice_ms),
        (1, 200),
        "`--phase-secs` names the rounds too"
    );
    assert_eq!((a.goal_us, a.shards), (Some(300), Some(2)));
    assert_eq!(a.plain_rate, 20 << 20);
    assert_eq!(a.shares, (800, 200));
    check_values(&a).unwrap();
}

#[test]
fn a_compaction_of_depth_zero_runs_the_foreground_alone() {
    let a = parse(&["--bg-depth", "0"]).unwrap();
    assert_eq!(a.bg_depth, 0);
    check_values(&a).unwrap();
    let err = check_values(&parse(&["--bg-depth", "257"]).unwrap()).unwrap_err();
    assert!(err.contains("--bg-depth"), "{err}");
}

#[test]
fn the_readers_go_where_the_disk_interrupts_and_the_compaction_elsewhere() {
    let split = |fg: &[usize], bg: &[usize]| Placement {
        fg: fg.to_vec(),
        bg: bg.to_vec(),
    };
    // Two shards, the disk interrupting shard 1's CPU.
    assert_eq!(Placement::new(2, &[1], false), split(&[1], &[0]));
    assert_eq!(Placement::new(4, &[0, 2], false), split(&[0, 2], &[1, 3]));
    // No split to make: every shard runs both, in turn.
    assert_eq!(
        Placement::new(2, &[], false),
        split(&[0, 1], &[0, 1]),
        "unknown"
    );
    assert_eq!(
        Placement::new(2, &[0, 1], false),
        split(&[0, 1], &[0, 1]),
        "all"
    );
    assert_eq!(
        Placement::new(1, &[0], false),
        split(&[0], &[0]),
        "one shard"
    );
    // --spread asks for every shard in turn whatever the disk does.
    assert!(parse(&["--spread"]).unwrap().spread);
    assert_eq!(Placement::new(2, &[1], true), split(&[0, 1], &[0, 1]));
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    for (flags, needle) in [
        (&["--goal-us", "0"][..], "--goal-us"),
        (&["--shards", "0"], "--shards"),
        (&["--slice-ms", "0"], "--slice-ms"),
        (&["--bg-kib", "6"], "--bg-kib"),
        (&["--bg-in-flight-us", "0"], "--bg-in-flight-us"),
        (&["--fg-iops", "0"], "--fg-iops"),
    ] {
        let err = check_values(&parse(flags).unwrap()).unwrap_err();
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
    assert!(parse(&["--shares", "0:1"]).is_err());
    assert!(parse(&["--plain-rate", "50 furlongs/s"]).is_err());
    assert!(
        parse(&["--piece-us", "100"]).is_err(),
        "the piece size is derived, not a flag"
    );
}

#[test]
fn arrivals_follow_the_schedule_however_late_the_reader_is() {
    // The whole schedule is in the past: a reader far behind it.
    let t0 = Instant::now()
        .checked_sub(Duration::from_secs(1))
        .expect("up for over a second");
    let ms = Duration::from_millis(1);
    let mut s = Schedule::new(t0, ms / 2, 2 * ms, 10 * ms);
    // 0.5, 2.5, 4.5, 6.5, 8.5 ms: five arrivals before 10 ms.
    assert_eq!(s.remaining(), 5);
    assert_eq!(s.next_arrival(), Some(t0 + ms / 2));
    // A reader that comes back late (say its read took 5 ms) still gets the arrival that was
    // scheduled, not "now": its latency will count from there.
    assert_eq!(s.next_arrival(), Some(t0 + 5 * ms / 2));
    assert_eq!(s.remaining(), 3);
    assert_eq!(s.next_arrival(), Some(t0 + 9 * ms / 2));
    // Giving up at 20 ms counts the two left with the latency they reached.
    let late = s.abandon(t0 + 20 * ms);
    assert_eq!(late, vec![20 * ms - 13 * ms / 2, 20 * ms - 17 * ms / 2]);
    assert_eq!(s.next_arrival(), None);
    assert_eq!(s.remaining(), 0);
}

#[test]
fn arrivals_do_not_drift_over_many_intervals() {
    let t0 = Instant::now();
    // 1/3 ms does not divide evenly into nanoseconds; the 3,000th arrival is still at 1 s.
    let third = Duration::from_nanos(333_333);
    let s = Schedule::new(t0, Duration::ZERO, third, Duration::from_secs(2));
    assert_eq!(s.arrival(3000), t0 + third * 3000);
    assert_eq!(s.remaining(), 6001); // ceil(2 s / 333,333 ns)
                                     // An offset past the span: nothing scheduled.
    let mut none = Schedule::new(t0, Duration::from_secs(3), third, Duration::from_secs(2));
    assert_eq!((none.remaining(), none.next_arrival()), (0, None));
}

#[test]
fn rounds_report_the_median_and_the_worst() {
    assert_eq!(median(&[]), None);
    assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
    let mut r = Rounds::default();
    for (p99_us, mb) in [(500, 300.0), (900, 250.0), (400, 320.0)] {
        r.push(Duration::from_micros(p99_us), mb);
    }
    assert_eq!(r.median_p99(), Duration::from_micros(500));
    assert_eq!(r.worst_p99(), Duration::from_micros(900));
    assert_eq!(r.median_bg(), 300.0);
    assert_eq!(r.worst_bg(), 250.0, "the worst bandwidth is the lowest");
}

#[test]
fn the_stall_watch_reports_the_worst_lateness_on_any_cpu_since_it_was_last_asked() {
    let w = StallWatch::by_hand(2);
    assert_eq!(w.take(), Some(Duration::ZERO), "nothing noted yet");
    w.note(0, Duration::from_millis(3));
    w.note(1, Duration::from_millis(7));
    w.note(0, Duration::from_millis(1));
    w.note(1, Duration::from_millis(2));
    assert_eq!(w.take(), Some(Duration::from_millis(7)), "the worst of all");
    assert_eq!(
        w.take(),
        Some(Duration::ZERO),
        "taken: counted again from zero"
    );
    w.note(1, Duration::from_micros(40));
    assert_eq!(w.take(), Some(Duration::from_micros(40)));
    assert_eq!(StallWatch::by_hand(0).take(), None, "no CPUs: no figure");
    // The real watch: a slot (and a thread) for each CPU the process may use, stopped on drop.
    let cpus = core_affinity::get_core_ids().map_or(0, |c| c.len());
    let live = StallWatch::start();
    assert_eq!(live.cpus(), cpus);
    assert_eq!(live.take().is_some(), cpus > 0);
    drop(live);
}
