//! What the phases report: a row per slice, the totals per phase, the side-by-side table and
//! the machine-readable `summary:` line.

use std::time::Duration;

use hdrhistogram::Histogram;

use crate::open_loop::Rounds;
use crate::phases::Phase;
use crate::stall::STALLED;

/// A read from issue to completion at least this long is listed after the tables: it held up
/// its reader's next arrivals.
const SLOW_READ: Duration = Duration::from_millis(5);

pub(crate) fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("constant bounds")
}

pub(crate) fn record(h: &mut Histogram<u64>, d: Duration) {
    h.saturating_record((d.as_nanos() as u64).max(1));
}

/// One slice of one phase.
pub(crate) struct Row {
    pub(crate) phase: Phase,
    pub(crate) round: u64,
    pub(crate) fg: Histogram<u64>,
    pub(crate) lag: Histogram<u64>,
    /// From a read's issue to its completion.
    pub(crate) io: Histogram<u64>,
    /// Seconds from the slice's start to its last read's end.
    pub(crate) elapsed: f64,
    pub(crate) bg_bytes: u64,
    /// Queue wait of the foreground in the dispatcher (dispatched phases).
    pub(crate) fg_queue_p99: Option<Duration>,
    /// The shards' idle-poll back-offs (dispatched phases): times a shard found its core
    /// wanted by another thread.
    pub(crate) backoffs: Option<u64>,
    pub(crate) busy_ms: Option<u64>,
    /// CPU clock ticks stolen by the hypervisor, and all, over the slice.
    pub(crate) steal: Option<(u64, u64)>,
    /// How late the machine's watch threads woke at worst over the slice
    /// ([`StallWatch`](crate::stall::StallWatch)).
    pub(crate) stall: Option<Duration>,
    pub(crate) fg_errors: u64,
    pub(crate) fg_abandoned: u64,
    pub(crate) bg_errors: u64,
}

impl Row {
    pub(crate) fn bg_mb_s(&self) -> f64 {
        self.bg_bytes as f64 / self.elapsed.max(1e-9) / 1e6
    }
}

/// One phase's totals over all rounds.
pub(crate) struct PhaseResult {
    pub(crate) phase: Phase,
    pub(crate) fg: Histogram<u64>,
    pub(crate) lag: Histogram<u64>,
    pub(crate) io: Histogram<u64>,
    pub(crate) elapsed: f64,
    pub(crate) bg_bytes: u64,
    pub(crate) backoffs: Option<u64>,
    pub(crate) busy_ms: Option<u64>,
    pub(crate) steal: Option<(u64, u64)>,
    /// The watch's worst over the rounds.
    pub(crate) stall: Option<Duration>,
    pub(crate) errors: (u64, u64, u64),
    pub(crate) rounds: Rounds,
}

impl PhaseResult {
    pub(crate) fn empty(phase: Phase) -> Self {
        PhaseResult {
            phase,
            fg: new_hist(),
            lag: new_hist(),
            io: new_hist(),
            elapsed: 0.0,
            bg_bytes: 0,
            backoffs: None,
            busy_ms: Some(0),
            steal: Some((0, 0)),
            stall: None,
            errors: (0, 0, 0),
            rounds: Rounds::default(),
        }
    }

    pub(crate) fn add(&mut self, r: &Row) {
        self.fg.add(&r.fg).expect("same bounds");
        self.lag.add(&r.lag).expect("same bounds");
        self.io.add(&r.io).expect("same bounds");
        self.elapsed += r.elapsed;
        self.bg_bytes += r.bg_bytes;
        if let Some(b) = r.backoffs {
            self.backoffs = Some(self.backoffs.unwrap_or(0) + b);
        }
        self.busy_ms = self.busy_ms.zip(r.busy_ms).map(|(a, b)| a + b);
        self.steal = self
            .steal
            .zip(r.steal)
            .map(|((s, t), (rs, rt))| (s + rs, t + rt));
        self.stall = self.stall.max(r.stall);
        self.errors.0 += r.fg_errors;
        self.errors.1 += r.fg_abandoned;
        self.errors.2 += r.bg_errors;
        self.rounds.push(q(&r.fg, 0.99), r.bg_mb_s());
    }

    pub(crate) fn bg_mb_s(&self) -> f64 {
        self.bg_bytes as f64 / self.elapsed.max(1e-9) / 1e6
    }

    pub(crate) fn busy(&self) -> Option<f64> {
        self.busy_ms
            .map(|b| b as f64 / (self.elapsed.max(1e-9) * 1000.0))
    }
}

/// Stolen ticks as a share of all, for the tables.
fn fmt_steal(steal: Option<(u64, u64)>) -> String {
    match steal {
        Some((s, t)) if t > 0 => format!("{:.1}%", s as f64 * 100.0 / t as f64),
        _ => "?".to_owned(),
    }
}

/// Idle-poll back-offs, for the tables; "–" where no dispatcher ran.
fn fmt_backoffs(backoffs: Option<u64>) -> String {
    backoffs.map_or("–".to_owned(), |b| b.to_string())
}

/// The watch's worst wake-up, for the tables; "–" without a watch (`--stall-watch`).
fn fmt_stall(stall: Option<Duration>) -> String {
    stall.map_or("–".to_owned(), fmt_d)
}

/// The largest value recorded.
pub(crate) fn max(h: &Histogram<u64>) -> Duration {
    Duration::from_nanos(h.max())
}

pub(crate) fn q(h: &Histogram<u64>, q: f64) -> Duration {
    if h.is_empty() {
        Duration::ZERO
    } else {
        Duration::from_nanos(h.value_at_quantile(q))
    }
}

pub(crate) fn fmt_d(d: Duration) -> String {
    if d >= Duration::from_millis(10) {
        format!("{:.1} ms", d.as_secs_f64() * 1e3)
    } else if d >= Duration::from_millis(1) {
        format!("{:.2} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.0} µs", d.as_secs_f64() * 1e6)
    }
}

pub(crate) fn print_header() {
    println!(
        "{:<11} {:>3} | {:>7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} | {:>8} | {:>5} {:>6} {:>9} | {:>5}",
        "phase",
        "rnd",
        "fg IOPS",
        "fg p50",
        "fg p99",
        "lag p99",
        "io p99",
        "io max",
        "qwait p99",
        "bg MB/s",
        "util",
        "steal",
        "stall",
        "b/o"
    );
}

pub(crate) fn print_row(r: &Row) {
    println!(
        "{:<11} {:>3} | {:>7.0} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} | {:>8.1} | {:>5} {:>6} {:>9} | {:>5}",
        r.phase.name(),
        r.round,
        r.fg.len() as f64 / r.elapsed.max(1e-9),
        fmt_d(q(&r.fg, 0.5)),
        fmt_d(q(&r.fg, 0.99)),
        fmt_d(q(&r.lag, 0.99)),
        fmt_d(q(&r.io, 0.99)),
        fmt_d(max(&r.io)),
        r.fg_queue_p99.map_or("–".to_owned(), fmt_d),
        r.bg_mb_s(),
        r.busy_ms.map_or("?".to_owned(), |b| format!(
            "{:.0}%",
            b as f64 / (r.elapsed.max(1e-9) * 10.0)
        )),
        fmt_steal(r.steal),
        fmt_stall(r.stall),
        fmt_backoffs(r.backoffs),
    );
}

/// The side-by-side table of the phases, and the targets line.
pub(crate) fn print_phases(results: &[PhaseResult], target_p99: Duration) {
    println!();
    println!(
        "{:<11} | {:>9} {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} {:>9} {:>9} | {:>8} {:>8} {:>8} | {:>5} {:>6} {:>9} | {:>5}",
        "phase",
        "p50",
        "p99",
        "p999",
        "med p99",
        "worst p99",
        "lag p99",
        "io p50",
        "io p99",
        "io max",
        "bg MB/s",
        "med",
        "worst",
        "util",
        "steal",
        "stall",
        "b/o"
    );
    println!(
        "{:<11} | {:>29} | {:>19} | {:>39} | {:>26} |",
        "",
        "fg latency from arrival",
        "p99 over rounds",
        "arrival→issue, issue→end",
        "compaction (all, median, worst)"
    );
    for r in results {
        println!(
            "{:<11} | {:>9} {:>9} {:>9} | {:>9} {:>9} | {:>9} {:>9} {:>9} {:>9} | {:>8.1} {:>8.1} {:>8.1} | {:>5} {:>6} {:>9} | {:>5}",
            r.phase.name(),
            fmt_d(q(&r.fg, 0.5)),
            fmt_d(q(&r.fg, 0.99)),
            fmt_d(q(&r.fg, 0.999)),
            fmt_d(r.rounds.median_p99()),
            fmt_d(r.rounds.worst_p99()),
            fmt_d(q(&r.lag, 0.99)),
            fmt_d(q(&r.io, 0.5)),
            fmt_d(q(&r.io, 0.99)),
            fmt_d(max(&r.io)),
            r.bg_mb_s(),
            r.rounds.median_bg(),
            r.rounds.worst_bg(),
            r.busy()
                .map_or("?".to_owned(), |b| format!("{:.0}%", b * 100.0)),
            fmt_steal(r.steal),
            fmt_stall(r.stall),
            fmt_backoffs(r.backoffs),
        );
        let (fe, fa, be) = r.errors;
        if fe + fa + be > 0 {
            println!(
                "  ({fe} foreground errors, {fa} arrivals given up after 4 slices (counted with the latency they reached), {be} compaction errors)"
            );
        }
    }
    let p99 = |p: Phase| q(&results[p.index()].fg, 0.99);
    let bw = |p: Phase| results[p.index()].bg_mb_s();
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
    let idle = p99(Phase::Idle);
    println!(
        "targets: iothrottle (thread-per-core) fg p99 / idle = {:.2} (≤ 1.3); cross-thread / idle = {:.2} (≤ 1.5); compaction iothrottle / plain = {:.2}× (≥ 5); iothrottle p99 / plain p99 = {:.2} (≤ 1 with --saturate); target {} (p99 {})",
        ratio(p99(Phase::IoThrottle), idle),
        ratio(p99(Phase::Cross), idle),
        bw(Phase::IoThrottle) / bw(Phase::Plain).max(1e-9),
        ratio(p99(Phase::IoThrottle), p99(Phase::Plain)),
        fmt_d(target_p99),
        fmt_d(p99(Phase::Target)),
    );
}

/// The slices to read with care: those where the machine's watch woke late (the machine, not
/// the route, held things up) and those with a read that took long from issue to completion
/// (one such read holds up its reader's next arrivals: the `lag` of the slice).
pub(crate) fn print_outliers(rows: &[Row], watched: bool) {
    let list = |at_least: Duration, pick: &dyn Fn(&Row) -> Option<Duration>| {
        let hits: Vec<String> = rows
            .iter()
            .filter_map(|r| {
                pick(r)
                    .filter(|d| *d >= at_least)
                    .map(|d| format!("{} {} ({})", r.phase.name(), r.round, fmt_d(d)))
            })
            .collect();
        if hits.is_empty() {
            "none".to_owned()
        } else {
            hits.join(", ")
        }
    };
    if watched {
        println!(
            "slices where the machine stalled (a watch thread woke {} late or more): {}",
            fmt_d(STALLED),
            list(STALLED, &|r: &Row| r.stall)
        );
    }
    println!(
        "slices with a read of {} or more from issue to completion: {}",
        fmt_d(SLOW_READ),
        list(SLOW_READ, &|r: &Row| Some(max(&r.io)))
    );
}

/// The machine-readable `summary:` line.
pub(crate) fn print_summary(results: &[PhaseResult]) {
    let p99 = |p: Phase| q(&results[p.index()].fg, 0.99);
    let bw = |p: Phase| results[p.index()].bg_mb_s();
    let idle = p99(Phase::Idle);
    let us = |d: Duration| d.as_micros();
    println!(
        "summary: idle_p99_us={} unthrottled_p99_us={} unthrottled_bg_mb_s={:.0} plain_p99_us={} plain_bg_mb_s={:.0} iothrottle_p99_us={} iothrottle_bg_mb_s={:.0} target_p99_us={} target_bg_mb_s={:.0} cross_p99_us={} cross_bg_mb_s={:.0}",
        us(idle),
        us(p99(Phase::Unthrottled)),
        bw(Phase::Unthrottled),
        us(p99(Phase::Plain)),
        bw(Phase::Plain),
        us(p99(Phase::IoThrottle)),
        bw(Phase::IoThrottle),
        us(p99(Phase::Target)),
        bw(Phase::Target),
        us(p99(Phase::Cross)),
        bw(Phase::Cross),
    );
}
