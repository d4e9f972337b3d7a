//! The one benchmark target (`harness = false`): each module brings its criterion group.
//!
//! Run one group with `cargo bench --bench benches -- <group>`.

mod bucket;
mod checkpoint;
mod disk;
mod dispatcher;
mod keyed;
mod pg;
mod throttle;

criterion::criterion_main!(
    bucket::benches,
    disk::benches,
    checkpoint::benches,
    dispatcher::benches,
    keyed::benches,
    pg::benches,
    throttle::benches
);
