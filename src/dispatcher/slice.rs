//! The shard threads' request to the OS scheduler: a short time slice.
//!
//! On Linux 6.12 and later (the EEVDF scheduler's custom slices), a thread of a fair policy may
//! ask for a shorter slice than the default with `sched_setattr` (`sched_runtime`); no
//! privilege is needed, since it asks for less CPU at a time, not more CPU. A woken thread
//! with a shorter slice gets an earlier virtual deadline and may preempt a thread running a
//! longer one, and a thread that runs at most one short slice at a time stays close to its
//! fair share, so it is usually eligible to run when it wakes again. A shard runs a little
//! at a time (a completion, a dispatch) thousands of times a second: with a short slice it gets
//! its core back quickly when an application thread keeps that core busy. Older kernels accept
//! the call and ignore the value.
//!
//! Measured in `docs/dispatcher.md` ("Busy cores: who runs when").

use std::io;
use std::time::Duration;

/// The shortest slice the kernel grants (it raises shorter requests to this).
pub(crate) const MIN: Duration = Duration::from_micros(100);
/// The longest slice the kernel grants (it lowers longer requests to this).
pub(crate) const MAX: Duration = Duration::from_millis(100);

/// `sched_setattr`'s flag that keeps a thread's children from inheriting its policy.
#[cfg(target_os = "linux")]
const RESET_ON_FORK: u64 = 0x01;

/// Asks for `slice` (within [`MIN`]`..=`[`MAX`]) for the calling thread, keeping its policy, its
/// nice value and its reset-on-fork flag. A thread of a real-time or deadline policy is left as
/// it is (`Ok(false)`): a slice is a fair-policy setting. `Ok(true)` when asked.
#[cfg(target_os = "linux")]
pub(crate) fn set_current(slice: Duration) -> io::Result<bool> {
    debug_assert!((MIN..=MAX).contains(&slice), "checked by the builder");
    let mut attr = current()?;
    if !matches!(
        attr.sched_policy as i32,
        libc::SCHED_OTHER | libc::SCHED_BATCH | libc::SCHED_IDLE
    ) {
        return Ok(false);
    }
    attr.size = size_of::<libc::sched_attr>() as u32;
    attr.sched_flags &= RESET_ON_FORK;
    attr.sched_priority = 0;
    // At most `MAX`: far within u64.
    attr.sched_runtime = slice.as_nanos() as u64;
    attr.sched_deadline = 0;
    attr.sched_period = 0;
    // SAFETY: pid 0 (the calling thread), a pointer to a live, fully initialised `sched_attr`
    // whose `size` says how much the kernel may read, flags 0.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0,
            &attr as *const libc::sched_attr,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// The calling thread's scheduling attributes (on Linux 6.12 and later, `sched_runtime` is its
/// slice for a fair policy).
#[cfg(target_os = "linux")]
pub(crate) fn current() -> io::Result<libc::sched_attr> {
    // SAFETY: `sched_attr` is plain integers; all-zero is a valid value.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 (the calling thread), a pointer to a live `sched_attr` and its size (the
    // kernel writes at most that much), flags 0.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut libc::sched_attr,
            size_of::<libc::sched_attr>() as u32,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

/// No custom slices outside Linux: nothing is asked.
#[cfg(not(target_os = "linux"))]
pub(crate) fn set_current(_slice: Duration) -> io::Result<bool> {
    Ok(false)
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::dispatcher::{ClassConfig, DiskModel, Dispatcher, DispatcherBuilder, Figures};
    use crate::BuildError;

    /// Whether the running kernel lacks custom slices (before Linux 6.12), said loudly: a
    /// thread asks for one and reads it back.
    fn no_custom_slices() -> bool {
        let kept = std::thread::spawn(|| {
            set_current(Duration::from_micros(300)).unwrap()
                && current().unwrap().sched_runtime == 300_000
        })
        .join()
        .unwrap();
        if !kept {
            eprintln!("!!!!!!!! SKIPPED !!!!!!!! this kernel has no custom slices (Linux < 6.12)");
        }
        !kept
    }

    #[test]
    fn a_thread_gets_the_slice_it_asks_for_and_keeps_its_nice_value() {
        if no_custom_slices() {
            return;
        }
        std::thread::spawn(|| {
            // A nicer thread (raising nice needs no privilege) stays as nice.
            // SAFETY: plain syscall on the calling thread.
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 5) }, 0);
            let before = current().unwrap();
            assert!(set_current(MIN).unwrap());
            let after = current().unwrap();
            assert_eq!(after.sched_runtime, 100_000);
            assert_eq!(after.sched_nice, 5);
            assert_eq!(after.sched_policy, before.sched_policy);
            assert!(set_current(MAX).unwrap());
            assert_eq!(current().unwrap().sched_runtime, 100_000_000);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_batch_thread_stays_batch() {
        if no_custom_slices() {
            return;
        }
        std::thread::spawn(|| {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: sets the calling thread's policy from a live `sched_param`.
            let set = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
            assert_eq!(set, 0);
            assert!(set_current(Duration::from_micros(250)).unwrap());
            let attr = current().unwrap();
            assert_eq!(attr.sched_policy as i32, libc::SCHED_BATCH);
            assert_eq!(attr.sched_runtime, 250_000);
        })
        .join()
        .unwrap();
    }

    /// Two shards, one class.
    fn two_shards(b: DispatcherBuilder) -> Result<Dispatcher, BuildError> {
        b.shards(2)
            .disk(DiskModel::symmetric(Figures {
                iops: 20_000,
                bandwidth: 200_000_000,
            }))
            .class(ClassConfig::new("io", 1))
            .build()
    }

    /// `f`'s answer on each shard, in shard order.
    fn on_each_shard<T: Send + 'static>(d: &Dispatcher, f: fn() -> T) -> Vec<T> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        (0..d.shards())
            .map(|s| {
                rt.block_on(d.spawn_on(s, move || async move { f() }).unwrap())
                    .unwrap()
            })
            .collect()
    }

    /// Each shard's slice, read on the shard, in ns.
    fn shard_slices(d: &Dispatcher) -> Vec<u64> {
        on_each_shard(d, || current().unwrap().sched_runtime)
    }

    #[test]
    fn shards_ask_for_the_default_slice_the_one_given_or_none() {
        if no_custom_slices() {
            return;
        }
        let d = two_shards(Dispatcher::builder()).unwrap();
        assert_eq!(shard_slices(&d), vec![100_000; 2]);
        d.shutdown();
        let d =
            two_shards(Dispatcher::builder().shard_slice(Some(Duration::from_millis(3)))).unwrap();
        assert_eq!(shard_slices(&d), vec![3_000_000; 2]);
        d.shutdown();
        // `None`: the slice any new thread of this one's gets.
        let plain = std::thread::spawn(|| current().unwrap().sched_runtime)
            .join()
            .unwrap();
        assert_ne!(plain, 100_000, "the default slice is not the shortest");
        let d = two_shards(Dispatcher::builder().shard_slice(None)).unwrap();
        assert_eq!(shard_slices(&d), vec![plain; 2]);
        d.shutdown();
    }

    #[test]
    fn the_start_hook_runs_after_the_slice_is_set_and_may_change_it() {
        if no_custom_slices() {
            return;
        }
        let d = two_shards(Dispatcher::builder().on_shard_start(|_| {
            assert_eq!(current()?.sched_runtime, 100_000, "set before the hook");
            set_current(Duration::from_micros(400)).map(drop)
        }))
        .unwrap();
        assert_eq!(shard_slices(&d), vec![400_000; 2]);
        d.shutdown();
    }

    /// Shards built from a real-time thread inherit its policy; they keep it and its priority
    /// (a slice is a fair-policy setting).
    #[test]
    fn shards_of_a_real_time_policy_are_left_as_they_are() {
        let built = std::thread::spawn(|| {
            let param = libc::sched_param { sched_priority: 1 };
            // SAFETY: sets the calling thread's policy from a live `sched_param`.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
                return None;
            }
            assert!(!set_current(MIN).unwrap(), "a FIFO thread is not asked");
            let d = two_shards(Dispatcher::builder()).unwrap();
            let attrs = on_each_shard(&d, || {
                let a = current().unwrap();
                (a.sched_policy, a.sched_priority)
            });
            d.shutdown();
            Some(attrs)
        })
        .join()
        .unwrap();
        match built {
            Some(attrs) => assert_eq!(attrs, vec![(libc::SCHED_FIFO as u32, 1); 2]),
            None => eprintln!(
                "!!!!!!!! SKIPPED !!!!!!!! no SCHED_FIFO for this process (needs CAP_SYS_NICE or \
                 RLIMIT_RTPRIO)"
            ),
        }
    }

    #[test]
    fn a_slice_the_os_would_not_grant_is_a_build_error() {
        for bad in [
            Duration::ZERO,
            Duration::from_nanos(99_999),
            Duration::from_nanos(100_000_001),
            Duration::from_secs(1),
        ] {
            match two_shards(Dispatcher::builder().shard_slice(Some(bad))) {
                Err(BuildError::ShardSliceOutOfRange { slice, min, max }) => {
                    assert_eq!((slice, min, max), (bad, MIN, MAX));
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        for bound in [MIN, MAX] {
            two_shards(Dispatcher::builder().shard_slice(Some(bound)))
                .unwrap()
                .shutdown();
        }
    }
}
