//! Regression tests for the examples' flags: every bad flag is a usage error (exit code 2, a
//! message naming the flag) before any work starts, never a panic or a `NaN%`.

use std::path::PathBuf;
use std::process::Command;

/// The example's binary, built on demand (`cargo test` builds the examples; `cargo test --test
/// adapter_examples` alone does not).
fn example(name: &str) -> PathBuf {
    let mut dir = std::env::current_exe().expect("test binary path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("examples").join(name);
    if !bin.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building example {name}");
    }
    bin
}

fn usage_error(name: &str, args: &[&str], flag: &str) {
    let out = Command::new(example(name))
        .args(args)
        .output()
        .expect("example runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(flag), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(stdout.is_empty(), "{args:?}: work started: {stdout}");
}

#[test]
fn throttle_accuracy_rate_zero_is_a_usage_error_not_a_panic() {
    usage_error("throttle_accuracy", &["--rate", "0"], "--rate");
}

#[test]
fn throttle_accuracy_seconds_zero_is_a_usage_error_not_nan() {
    usage_error("throttle_accuracy", &["--seconds", "0"], "--seconds");
}

#[test]
fn throttle_accuracy_only_that_matches_nothing_is_a_usage_error() {
    usage_error(
        "throttle_accuracy",
        &["--only", "no-such-limiter"],
        "--only",
    );
}

#[test]
fn keyed_memory_zero_keys_is_a_usage_error() {
    usage_error("keyed_memory", &["--keys", "0"], "--keys");
}

/// The main job refuses a bad flag with a message naming it (exit 1), before measuring or
/// writing anything: nothing on stdout.
fn refused_before_work(name: &str, args: &[&str], flag: &str) {
    let out = Command::new(example(name))
        .args(args)
        .output()
        .expect("example runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{args:?} was accepted");
    assert!(stderr.contains(flag), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(stdout.is_empty(), "{args:?}: work started: {stdout}");
}

#[test]
fn disk_throttle_refuses_bad_flags_before_any_work() {
    refused_before_work("disk_throttle", &["--bg-kib", "100000000"], "--bg-kib");
    refused_before_work("disk_throttle", &["--fg-depth", "0"], "--fg-depth");
    refused_before_work(
        "disk_throttle",
        &["--plot", "/nonexistent/x.svg"],
        "/nonexistent/x.svg",
    );
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts.lines().any(|l| l.contains(" /dev/shm tmpfs ")) {
        refused_before_work("disk_throttle", &["--dir", "/dev/shm"], "tmpfs");
    }
}
