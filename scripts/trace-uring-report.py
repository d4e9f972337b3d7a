#!/usr/bin/env python3
"""The report of scripts/trace-uring: per slice of the main job, the kernel's share of its 4 KiB
reads (io_uring_submit_req to io_uring_complete of each READ that returned 4096 bytes, matched by
ring and request) beside the job's own `io p99` and `io max` for the slice.

    python3 scripts/trace-uring-report.py SCRIPT_TXT JOB_TXT

A slice's window runs from the job's previous row to its own (the job prints a row as its slice
ends). io_uring posts a read's completion from the task work of the thread that submitted it, so
the kernel's share is the block layer's queue and the device, plus the submitting thread's way
back to a CPU to run that work (a thread waiting for its CPU shows here, not in the job's share).
Where the kernel's max is close to the job's, the slowest read was slow there; where the job's is
well above it, the time went after the completion was posted (the reaper, the runtime's wake-up
of the reader). The two maxima need not be the same read.
"""
import bisect
import re
import sys

EVENT = re.compile(
    r"\[(\d+)\]\s+([\d.]+):\s+io_uring:(io_uring_submit_req|io_uring_complete): "
    r"ring ([^,]+), req ([^,]+), user_data ([^,]+), (?:opcode ([^,]+)|result (-?\d+))"
)
ROW = re.compile(r"^(?P<t>\d+\.\d+) (?P<phase>idle|plain|iothrottle|cross|target|unthrottled)\s+(?P<rnd>\d+) \|(?P<rest>.*)$")
# The job's slice row: fg IOPS, fg p50, fg p99, lag p99, io p99, io max (each "N unit").
DUR = r"([\d.]+ [µm]?s)"


def us(text):
    v, unit = text.split()
    return float(v) * {"µs": 1, "ms": 1e3, "s": 1e6}[unit]


def job_rows(path):
    rows = []
    prev = None
    for line in open(path, encoding="utf-8"):
        m = ROW.match(line.rstrip("\n"))
        if not m:
            continue
        t = float(m["t"])
        durs = re.findall(DUR, m["rest"].split("|")[0])
        io_p99, io_max = (us(durs[3]), us(durs[4])) if len(durs) >= 5 else (None, None)
        rows.append((prev if prev is not None else t - 1.1, t, m["phase"], int(m["rnd"]), io_p99, io_max))
        prev = t
    return rows


def kernel_reads(path):
    submitted = {}
    done = []
    for line in open(path, encoding="utf-8", errors="replace"):
        if "io_uring:" not in line:
            continue
        m = EVENT.search(line)
        if not m:
            continue
        _cpu, t, ev, ring, req, _ud, opcode, res = m.groups()
        t = float(t)
        if ev == "io_uring_submit_req":
            if opcode == "READ":
                submitted[(ring, req)] = t
        else:
            t0 = submitted.pop((ring, req), None)
            if t0 is not None and res == "4096":
                done.append((t, (t - t0) * 1e6))
    done.sort()
    return done


def fmt(x):
    return "–" if x is None else "%.0f" % x


def q(sorted_values, p):
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * p))]


def main():
    script, job = sys.argv[1], sys.argv[2]
    reads = kernel_reads(script)
    times = [t for t, _ in reads]
    print("times in µs; kernel: io_uring_submit_req to io_uring_complete of the 4 KiB reads")
    print("%-11s %3s | %6s %8s %8s %9s | %8s %9s | %s" % (
        "phase", "rnd", "reads", "p50", "p99", "max", "job p99", "job max", "job max - kernel max"))
    for start, end, phase, rnd, io_p99, io_max in job_rows(job):
        i, j = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        v = sorted(x for _, x in reads[i:j])
        if not v:
            continue
        print("%-11s %3d | %6d %8.0f %8.0f %9.0f | %8s %9s | %s" % (
            phase, rnd, len(v), q(v, .5), q(v, .99), v[-1], fmt(io_p99), fmt(io_max),
            fmt(None if io_max is None else io_max - v[-1])))


if __name__ == "__main__":
    main()
