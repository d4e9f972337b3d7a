#!/usr/bin/env python3
"""Who runs when the shards are late: reads `perf script` output of a `perf sched record` of
the main job, and the job's stdout with a CLOCK_MONOTONIC time in front of each line (both
written by scripts/trace-shards), and prints per slice of each phase:

  wake    the delay from a shard thread's sched_waking to its sched_switch onto a CPU
  preempt the time a shard thread preempted (switched out runnable) waited to run again
  D       the time a shard thread spent blocked in the kernel (uninterruptible)
  run     the longest stretch a shard thread ran without switching out
  mig     how often a shard thread changed CPU
  disk    the device time of the 4 KiB reads (block_rq_issue to block_rq_complete): p99, max,
          and `seen`: the reads it is taken over, of those issued in the slice
  culprits: for the delays over 1 ms, which tasks held the CPU meanwhile (ms, summed)

A trace can lack the events raised as a CPU leaves idle: on the benchmarks' VM, perf records
block_rq_complete for 4 or 5 of 2,000 reads by `dd` at depth 1 with the CPUs idle and for all
2,000 with a busy loop on each CPU, and the switches out of the idle task fall short of those
into it. The wake-ups of threads onto an idle CPU and the completions taken there are then
missing; the report says so above its table when the switches out of the idle task number
under 95% of those into it. `<idle>` among the tasks that held a CPU may then be such a gap: a
lost switch out of the idle task leaves the idle task on that CPU until the next one recorded.

Usage: trace-shards-report.py SCRIPT_TXT STDOUT_TXT [PID]

TRACE_THREADS=PREFIX in the environment follows the job's threads whose names start with PREFIX
(the kernel keeps 15 characters of a name) instead of the shards.
"""
import os
import re
import sys
from collections import defaultdict

EV = re.compile(
    r"^\s*(?P<comm>.+?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<t>\d+\.\d+):\s+"
    r"(?:sched|block):(?P<ev>\w+):\s+(?P<rest>.*)$"
)
SWITCH = re.compile(
    r"prev_comm=(?P<pc>.+?) prev_pid=(?P<pp>\d+) prev_prio=\d+ prev_state=(?P<ps>\S+) ==> "
    r"next_comm=(?P<nc>.+?) next_pid=(?P<np>\d+)"
)
WAKING = re.compile(r"comm=(?P<c>.+?) pid=(?P<p>\d+) prio=\d+ target_cpu=(?P<cpu>\d+)")
MIGRATE = re.compile(r"comm=(?P<c>.+?) pid=(?P<p>\d+) prio=\d+ orig_cpu=(?P<o>\d+) dest_cpu=(?P<d>\d+)")
BLOCK = re.compile(r"^(?P<dev>\d+,\d+) (?P<rwbs>\S+) (?:\d+ )?\(\S*\) (?P<sector>\d+) \+ (?P<n>\d+)")
ROW = re.compile(r"^(?P<t>\d+\.\d+) (?P<phase>idle|plain|iothrottle|cross|target|unthrottled)\s+(?P<rnd>\d+) \|(?P<rest>.*)$")


def q(xs, p):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main():
    script, out = sys.argv[1], sys.argv[2]
    pid_filter = int(sys.argv[3]) if len(sys.argv) > 3 else None

    rows = []
    prev_t = None
    for line in open(out, errors="replace"):
        m = ROW.match(line)
        if m:
            t = float(m["t"])
            rows.append((prev_t if prev_t is not None else t - 1.1, t, m["phase"], int(m["rnd"]), m["rest"].strip()))
            prev_t = t
        elif re.match(r"^\d+\.\d+ ", line) and prev_t is None and "scratch" in line:
            pass
    if not rows:
        sys.exit("no slice rows in " + out)

    # tid -> comm for the traced process; spinners are the process's threads named like it
    comm_of = {}
    pid_of = {}
    events = []
    for line in open(script, errors="replace"):
        m = EV.match(line)
        if not m:
            continue
        pid, tid = int(m["pid"]), int(m["tid"])
        comm_of[tid] = m["comm"].strip()
        pid_of[tid] = pid
        events.append((float(m["t"]), int(m["cpu"]), m["ev"], m["rest"], tid, m["comm"].strip()))
    events.sort(key=lambda e: e[0])

    if pid_filter is None:
        # the main job's process (its main thread is named after it), else the process that
        # owns the most shard threads
        jobs = [t for t, c in comm_of.items() if t == pid_of[t] and c.startswith("disk_throttle")]
        if jobs:
            pid_filter = jobs[-1]
    if pid_filter is None:
        counts = defaultdict(int)
        for tid, c in comm_of.items():
            if c.startswith("iothrottle-shar"):
                counts[pid_of[tid]] += 1
        pid_filter = max(counts, key=counts.get) if counts else -1

    # The threads followed: the shards by default; TRACE_THREADS names another prefix of the
    # job's thread names (e.g. tokio-rt-worker, the cross-thread phase's submitting runtime).
    followed = os.environ.get("TRACE_THREADS", "iothrottle-shar")[:15]

    def is_shard(tid, comm):
        return comm.startswith(followed) and pid_of.get(tid) == pid_filter

    def label(tid, comm):
        if pid_of.get(tid) == pid_filter:
            if comm.startswith("disk_throttle") and tid != pid_filter:
                return "spinner(job)"
            return comm + "(job)"
        if comm == "swapper" or tid == 0:
            return "<idle>"
        return re.sub(r"[/:]\d+.*$", "", comm)

    # per-window accumulators
    def acc():
        return {
            "wake": [], "preempt": [], "d": [], "run": [], "mig": 0,
            "culprits": defaultdict(float), "big": [], "read": [], "issued": 0, "by": defaultdict(int),
        }
    wins = [acc() for _ in rows]
    starts = [r[0] for r in rows]

    import bisect

    def win(t):
        i = bisect.bisect_right(starts, t) - 1
        if 0 <= i < len(rows) and t <= rows[i][1]:
            return wins[i]
        return None

    cur = {}  # cpu -> (tid, comm, since)
    # timeline per cpu of who ran: list of (t0, t1, label) for culprit attribution
    timeline = defaultdict(list)
    issued = {}  # (dev, sector) -> time a 4 KiB read was issued
    state = {}  # shard tid -> ("wait", t, kind) | ("run", t)
    # Switches into and out of the idle task: equal in a complete trace (a CPU that goes idle
    # leaves it again), fewer out of it where events raised as a CPU leaves idle are lost.
    idle_in = idle_out = 0
    for t, cpu, ev, rest, tid, comm in events:
        if ev == "sched_switch":
            m = SWITCH.match(rest)
            if not m:
                continue
            pp, np_ = int(m["pp"]), int(m["np"])
            idle_in += np_ == 0
            idle_out += pp == 0
            prev = cur.get(cpu)
            if prev is not None:
                timeline[cpu].append((prev[2], t, label(prev[0], prev[1])))
            cur[cpu] = (np_, m["nc"], t)
            if is_shard(pp, m["pc"]):
                s = state.get(pp)
                if s and s[0] == "run":
                    w = win(t)
                    if w is not None:
                        w["run"].append(t - s[1])
                ps = m["ps"]
                if ps.startswith("R"):
                    state[pp] = ("wait", t, "preempt", cpu)
                    w = win(t)
                    if w is not None:
                        w["by"][label(np_, m["nc"])] += 1
                elif ps.startswith("D"):
                    state[pp] = ("blocked", t)
                else:
                    state[pp] = ("sleep", t)
            if is_shard(np_, m["nc"]):
                s = state.get(np_)
                if s and s[0] == "wait":
                    d = t - s[1]
                    w = win(t)
                    if w is not None:
                        w[s[2]].append(d)
                        if d > 1e-3:
                            w["big"].append((s[1], t, cpu, s[2], np_))
                state[np_] = ("run", t)
        elif ev == "sched_waking":
            m = WAKING.match(rest)
            if not m:
                continue
            p = int(m["p"])
            if is_shard(p, m["c"]):
                s = state.get(p)
                if s and s[0] == "blocked":
                    w = win(t)
                    if w is not None:
                        w["d"].append(t - s[1])
                if not s or s[0] != "run":
                    state[p] = ("wait", t, "wake", int(m["cpu"]))
        elif ev in ("block_rq_issue", "block_rq_complete"):
            m = BLOCK.match(rest)
            if not m or not m["rwbs"].startswith("R") or m["n"] != "8":
                continue
            key = (m["dev"], m["sector"])
            if ev == "block_rq_issue":
                w = win(t)
                if w is not None:
                    w["issued"] += 1
                issued[key] = t
            elif key in issued:
                w = win(t)
                if w is not None:
                    w["read"].append(t - issued.pop(key))
        elif ev == "sched_migrate_task":
            m = MIGRATE.match(rest)
            if m and is_shard(int(m["p"]), m["c"]):
                w = win(t)
                if w is not None:
                    w["mig"] += 1

    # culprits: who ran on the CPU during each delay over 1 ms
    ends = {cpu: [seg[1] for seg in segs] for cpu, segs in timeline.items()}
    for w in wins:
        for t0, t1, cpu, kind, tid in w["big"]:
            segs = timeline[cpu]
            i = bisect.bisect_right(ends.get(cpu, []), t0)
            while i < len(segs) and segs[i][0] < t1:
                a, b, lab = segs[i]
                w["culprits"][lab] += (min(b, t1) - max(a, t0)) * 1e3
                i += 1

    def ms(x):
        return "%.2f" % (x * 1e3)

    print("pid %d; times in ms; delays over 1 ms are attributed to the tasks on the CPU meanwhile" % pid_filter)
    # A trace that lost the events raised as CPUs leave idle (the wake-ups of threads onto an
    # idle CPU, the completions of its interrupts) undercounts: say so before the figures.
    if idle_in and idle_out < 0.95 * idle_in:
        print("incomplete trace: %d switches out of the idle task recorded against %d into it; "
              "wake-ups onto an idle CPU and block completions taken there are missing from "
              "`wakes` and `disk`" % (idle_out, idle_in))
    print("%-11s %3s | %6s %6s %6s %6s %5s | %6s %6s %6s %5s | %5s %6s | %6s | %3s | %8s %6s %11s | %s" % (
        "phase", "rnd", "wakes", "p50", "p99", "max", ">1ms", "preem", "p99", "max", ">1ms",
        "D", "D max", "runmax", "mig", "disk p99", "max", "seen", "job row / culprits"))
    for (a, b, phase, rnd, rest), w in zip(rows, wins):
        if not w["wake"] and not w["preempt"]:
            continue
        cul = sorted(w["culprits"].items(), key=lambda kv: -kv[1])[:4]
        print("%-11s %3d | %6d %6s %6s %6s %5d | %6d %6s %6s %5d | %5d %6s | %6s | %3d | %8s %6s %11s | %s" % (
            phase, rnd, len(w["wake"]), ms(q(w["wake"], .5)), ms(q(w["wake"], .99)),
            ms(max(w["wake"], default=0)), sum(1 for x in w["wake"] if x > 1e-3),
            len(w["preempt"]), ms(q(w["preempt"], .99)), ms(max(w["preempt"], default=0)),
            sum(1 for x in w["preempt"] if x > 1e-3), len(w["d"]), ms(max(w["d"], default=0)),
            ms(max(w["run"], default=0)), w["mig"], ms(q(w["read"], .99)),
            ms(max(w["read"], default=0)), "%d/%d" % (len(w["read"]), w["issued"]), rest))
        if cul:
            print("%-11s     | held the CPU (ms): %s" % ("", ", ".join("%s %.1f" % kv for kv in cul)))
        edges = [0.1e-3, 1e-3, 2e-3, 4e-3, 10e-3]
        def hist(xs):
            h = [0] * (len(edges) + 1)
            for x in xs:
                h[sum(1 for e in edges if x >= e)] += 1
            return "/".join(str(n) for n in h)
        by = sorted(w["by"].items(), key=lambda kv: -kv[1])[:3]
        print("%-11s     | wake %s, preempt %s (<0.1/0.1-1/1-2/2-4/4-10/>10 ms); preempted by %s" % (
            "", hist(w["wake"]), hist(w["preempt"]), ", ".join("%s %d" % kv for kv in by)))


if __name__ == "__main__":
    main()
