//! The one benchmark target (`harness = false`): each module brings its criterion group.
//!
//! Run one group with `cargo bench --bench benches -- <group>`.

mod bucket;
mod checkpoint;
mod disk;
mod dispatcher;
mod keyed;
mod pg;
#[cfg(feature = "shm")]
mod shm;
mod threads;
mod throttle;

// `criterion_main!` spelled out, so that the second process of the `shm` group's `2p` cases
// (this binary, re-run) does its part and nothing else.
fn main() {
    #[cfg(feature = "shm")]
    if shm::child_if_asked() {
        return;
    }
    bucket::benches();
    disk::benches();
    checkpoint::benches();
    dispatcher::benches();
    keyed::benches();
    pg::benches();
    throttle::benches();
    #[cfg(feature = "shm")]
    shm::benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
