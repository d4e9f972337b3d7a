#![cfg(feature = "rt")] // the tokio layers; the bucket alone is tested without them
//! io-properties files: iotune's format, mount points, unreadable files.

use std::path::Path;

use iothrottle::disk::{calibrate, mountpoint_of, CalibrateOptions, IoProperties};
use iothrottle::dispatcher::Figures;
use iothrottle::DiskModel;
use iothrottle::PropertiesError;

const IOTUNE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/iotune_io_properties.yaml"
);

#[test]
fn reads_a_file_written_by_iotune() {
    // The exact shape of Seastar iotune's emitter, with the optional keys it adds.
    let model = DiskModel::from_properties(IOTUNE).unwrap();
    assert_eq!(
        model,
        DiskModel {
            read: Figures {
                iops: 507_847,
                bandwidth: 2_601_181_952,
            },
            write: Figures {
                iops: 451_066,
                bandwidth: 1_434_058_752,
            },
        }
    );
    let props = IoProperties::load(IOTUNE).unwrap();
    assert_eq!(props.disks[0].read_saturation_length, Some(131_072));
    assert_eq!(props.disks[0].write_saturation_length, Some(65_536));
    // Our writer produces the same text back (same keys, same order).
    assert_eq!(props.to_yaml(), std::fs::read_to_string(IOTUNE).unwrap());
    let same = DiskModel::from_properties_for(IOTUNE, "/var/lib/scylla/").unwrap();
    assert_eq!(same, model);
}

#[test]
fn another_mountpoint_is_a_typed_error_naming_both() {
    let err = DiskModel::from_properties_for(IOTUNE, "/srv/data").unwrap_err();
    match &err {
        PropertiesError::OtherMountpoint { wanted, found, .. } => {
            assert_eq!(wanted, "/srv/data");
            assert_eq!(found, &vec!["/var/lib/scylla".to_owned()]);
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("/srv/data") && text.contains("/var/lib/scylla"),
        "{text}"
    );
}

#[test]
fn unreadable_files_are_typed_errors() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let missing = dir.path().join("nope.yaml");
    assert!(matches!(
        DiskModel::from_properties(&missing),
        Err(PropertiesError::Read { ref path, ref source })
            if path == &missing && source.kind() == std::io::ErrorKind::NotFound
    ));
    // A directory where the file should be.
    assert!(matches!(
        DiskModel::from_properties(dir.path()),
        Err(PropertiesError::Read { .. })
    ));
    // Not UTF-8.
    let binary = dir.path().join("binary.yaml");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x81]).unwrap();
    assert!(matches!(
        DiskModel::from_properties(&binary),
        Err(PropertiesError::Read { .. })
    ));
    // Not an io-properties document.
    let junk = dir.path().join("junk.yaml");
    std::fs::write(&junk, "hello: world\n").unwrap();
    assert!(matches!(
        DiskModel::from_properties(&junk),
        Err(PropertiesError::Syntax { .. })
    ));
}

#[test]
fn several_disks_need_a_mountpoint() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let f = dir.path().join("two.yaml");
    std::fs::write(
        &f,
        "disks:\n  - mountpoint: /a\n    read_iops: 1\n    read_bandwidth: 2\n    write_iops: 3\n    \
         write_bandwidth: 4\n  - mountpoints:\n      - /b\n      - /c\n    read_iops: 95000\n    \
         read_bandwidth: 545M\n    write_iops: 85000\n    write_bandwidth: 510M\n    \
         write_saturation_length: 64k\n",
    )
    .unwrap();
    assert!(matches!(
        DiskModel::from_properties(&f),
        Err(PropertiesError::Ambiguous { count: 2, .. })
    ));
    let c = DiskModel::from_properties_for(&f, "/c").unwrap();
    assert_eq!(
        c,
        DiskModel::new(
            Figures {
                iops: 95_000,
                bandwidth: 545 << 20
            },
            Figures {
                iops: 85_000,
                bandwidth: 510 << 20
            }
        )
    );
}

#[test]
fn calibrated_file_loads_for_its_directory() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let options = CalibrateOptions {
        seconds: 5,
        file_size: 64 << 20,
        ..CalibrateOptions::default()
    };
    let props = calibrate(dir.path(), &options).unwrap();
    let out = dir.path().join("io_properties.yaml");
    props.write(&out).unwrap();
    // Nothing left behind but the properties file: the scratch file is gone.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("io_properties.yaml")]);
    let d = &props.disks[0];
    assert!(d.read_iops > 0 && d.write_iops > 0 && d.read_bandwidth > 0 && d.write_bandwidth > 0);
    assert_eq!(
        Path::new(d.mountpoint()),
        mountpoint_of(dir.path()).unwrap()
    );
    let model = DiskModel::from_properties_for_dir(&out, dir.path()).unwrap();
    assert_eq!(model, d.disk_model());
    model.validate().unwrap();
}

#[test]
fn a_byte_order_mark_before_the_first_key_is_accepted() {
    let text = std::fs::read_to_string(IOTUNE).unwrap();
    let with_bom = format!("\u{feff}{text}");
    assert_eq!(
        IoProperties::parse(&with_bom).unwrap(),
        IoProperties::parse(&text).unwrap()
    );
    let dir = std::env::temp_dir().join(format!("iothrottle-bom-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("io_properties.yaml");
    std::fs::write(&file, with_bom.as_bytes()).unwrap();
    assert_eq!(
        IoProperties::load(&file).unwrap(),
        IoProperties::load(IOTUNE).unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
