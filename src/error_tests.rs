//! Every error with a cause prints only its own message in `Display` and gives the cause from
//! `source()`, so a reporter that prints the chain (anyhow, eyre) prints each cause once.

use std::error::Error;
#[cfg(feature = "rt")]
use std::io;
use std::time::Duration;

#[cfg(feature = "rt")]
use crate::CheckpointError;
#[cfg(feature = "rt")]
use crate::{
    BuildError, CalibrateError, ControlError, DiskError, DispatchError, PropertiesError,
    SubmitError,
};
use crate::{ConfigError, ParseRateError};

/// Walks `e`'s `source()` chain and checks that no message contains its cause's text, so a
/// reporter that prints the chain (anyhow, eyre) prints each cause once. Returns the
/// number of links.
fn check_chain(e: &(dyn Error + 'static)) -> usize {
    let mut links = 1;
    let mut cur = e;
    while let Some(cause) = cur.source() {
        let (msg, inner) = (cur.to_string(), cause.to_string());
        assert!(
            !msg.contains(&inner),
            "{msg:?} repeats its cause {inner:?} ({cur:?})"
        );
        links += 1;
        cur = cause;
    }
    links
}

#[cfg(feature = "rt")]
fn io_error() -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, "the OS said no")
}

/// The errors of the tokio layers (checkpoint, dispatcher) that have a cause.
#[cfg(feature = "rt")]
fn rt_errors_with_a_cause() -> Vec<Box<dyn Error + 'static>> {
    vec![
        Box::new(CheckpointError::Io {
            path: "/x/b.ckpt".into(),
            op: "write",
            source: io_error(),
        }),
        Box::new(CheckpointError::Config(config_error())),
        Box::new(BuildError::Bucket(config_error())),
        Box::new(BuildError::Spawn {
            shard: 1,
            source: io_error(),
        }),
        Box::new(BuildError::ShardStart {
            shard: 1,
            source: io_error(),
        }),
        Box::new(ControlError::Cap(config_error())),
    ]
}

#[cfg(not(feature = "rt"))]
fn rt_errors_with_a_cause() -> Vec<Box<dyn Error + 'static>> {
    Vec::new()
}

fn config_error() -> ConfigError {
    ConfigError::ZeroRate {
        tokens: 0,
        period: Duration::from_secs(1),
    }
}

#[test]
fn no_error_prints_its_cause_twice() {
    let mut with_a_cause: Vec<Box<dyn Error + 'static>> = vec![
        Box::new(ParseRateError::Invalid {
            input: "0/s".into(),
            source: config_error(),
        }),
        Box::new(crate::KeyedConfigError::Bucket(config_error())),
    ];
    with_a_cause.extend(rt_errors_with_a_cause());
    #[cfg(all(feature = "shm", unix))]
    with_a_cause.extend([
        Box::new(crate::ShmError::Config(config_error())) as Box<dyn Error + 'static>,
        Box::new(crate::ShmError::Io {
            op: "open",
            path: "/dev/shm/b".into(),
            source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, "the OS said no"),
        }),
    ]);
    for e in &with_a_cause {
        assert!(check_chain(e.as_ref()) >= 2, "{e:?} has no cause");
    }
}

#[cfg(feature = "rt")]
#[test]
fn no_disk_error_prints_its_cause_twice() {
    let with_a_cause: Vec<Box<dyn Error + 'static>> = vec![
        Box::new(DiskError::NoSpace {
            offset: 0,
            len: 4096,
            source: io_error(),
        }),
        Box::new(DiskError::Submit(SubmitError::ShutDown)),
        Box::new(DiskError::Dispatch(DispatchError::ShutDown)),
        Box::new(DiskError::Io {
            op: "open",
            path: "/x/f".into(),
            source: io_error(),
        }),
        Box::new(PropertiesError::Read {
            path: "/x/io_properties.yaml".into(),
            source: io_error(),
        }),
        Box::new(PropertiesError::Mountpoint {
            path: "/x".into(),
            source: io_error(),
        }),
        Box::new(CalibrateError::NoIoUring(io_error())),
        Box::new(CalibrateError::Disk(DiskError::NoSpace {
            offset: 0,
            len: 4096,
            source: io_error(),
        })),
        Box::new(CalibrateError::Properties(PropertiesError::Read {
            path: "/x/io_properties.yaml".into(),
            source: io_error(),
        })),
    ];
    for e in &with_a_cause {
        assert!(check_chain(e.as_ref()) >= 2, "{e:?} has no cause");
    }
}

/// The cause is still there, one `source()` away, with its own text.
#[cfg(feature = "rt")]
#[test]
fn the_cause_comes_from_source() {
    let e = CheckpointError::Io {
        path: "/x/b.ckpt".into(),
        op: "fsync",
        source: io_error(),
    };
    assert_eq!(e.to_string(), "checkpoint file /x/b.ckpt: fsync failed");
    assert_eq!(e.source().unwrap().to_string(), "the OS said no");
}
