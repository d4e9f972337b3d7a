//! Where a disk's completions arrive: the CPUs that take the interrupts of the device holding a
//! path, read from sysfs and `/proc/interrupts`.
//!
//! A read submitted through io_uring completes on the CPU that takes the device's interrupt, and
//! the kernel then hands the completion to the thread that submitted it. When that thread runs on
//! another CPU, every completion costs a wake-up across CPUs (an inter-processor interrupt, and on
//! a virtual machine an exit to the hypervisor). Seastar's deployments move the interrupts to
//! chosen cores (`perftune.py`, which needs root); an engine without root can do the converse and
//! run its latency-bound reads on the [shards](crate::Dispatcher::shards_on) pinned where the
//! interrupts already arrive. docs/dispatcher.md, "Where the disk interrupts", has the figures.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A CPU that a disk's completion interrupts are delivered to, as [`completion_cpus`] finds
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterruptCpu {
    /// The CPU's number (as `core_affinity` and `/proc/interrupts` count them).
    pub cpu: usize,
    /// The device's completion interrupts this CPU has taken since boot: 0 before any, or for
    /// a CPU a vector has just been moved to.
    pub count: u64,
}

/// The CPUs the completion interrupts of the block device holding `path` are delivered to now,
/// the busiest first.
///
/// The device is the one `path`'s file system lives on: a partition counts as its disk, and a
/// device-mapper or md device as the disks under it. Its interrupt vectors are the PCI function's
/// MSI/MSI-X vectors (or its legacy line), found by walking up from the block device in sysfs.
/// The vectors that carry completions are those with at least 1% of the device's interrupts
/// since boot (`/proc/interrupts`; a configuration vector takes a handful), or all of them
/// before any has fired. The CPUs are where those vectors are routed now
/// (`/proc/irq/N/effective_affinity_list`), so a vector that irqbalance or an administrator has
/// moved is counted where it goes, not where it went; each is ranked by the completion
/// interrupts it has taken. Where the routing cannot be read, the CPUs that took at least 1% of
/// them are returned instead.
///
/// An empty list means the interrupts cannot be told: a file system without a block device
/// (tmpfs, or btrfs's anonymous device numbers), a device with no PCI ancestor (loop, zram,
/// virtio over MMIO), or a kernel that hides `/proc/interrupts` and the routing.
///
/// # Errors
///
/// `path` cannot be read (its metadata). A sysfs or procfs entry that is missing or unreadable
/// is not an error; it makes the list shorter or empty.
///
/// ```no_run
/// use iothrottle::disk::completion_cpus;
///
/// let cpus: Vec<usize> = completion_cpus("/var/lib/data")?.iter().map(|c| c.cpu).collect();
/// println!("the data disk interrupts CPUs {cpus:?}");
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn completion_cpus(path: impl AsRef<Path>) -> io::Result<Vec<InterruptCpu>> {
    let dev = std::fs::metadata(path)?.dev();
    Ok(Roots::system().completion_cpus(libc::major(dev), libc::minor(dev)))
}

/// How long [`completion_cpus_of`] trusts what it found for a device: irqbalance moves vectors
/// every ten seconds at most.
const TRUST: Duration = Duration::from_secs(10);

/// The CPUs (numbers only) of [`completion_cpus`] for the device holding `file`, looked up once
/// per device every [`TRUST`] in a process: reading `/proc/interrupts` costs more than opening
/// a file, and an engine opens many files on one disk. Empty when it cannot be told.
pub(crate) fn completion_cpus_of(file: &File) -> Arc<[usize]> {
    static SEEN: OnceLock<Mutex<Seen>> = OnceLock::new();
    let Ok(meta) = file.metadata() else {
        return Arc::from([]);
    };
    let dev = meta.dev();
    // The map is whole at every point (a lookup that panicked inserted nothing): a poisoned
    // lock is used as it is.
    let mut seen = SEEN
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    seen.get(dev, Instant::now(), || {
        Roots::system()
            .completion_cpus(libc::major(dev), libc::minor(dev))
            .iter()
            .map(|c| c.cpu)
            .collect()
    })
}

/// What [`completion_cpus_of`] found per device number, and when.
#[derive(Debug, Default)]
struct Seen(HashMap<u64, (Instant, Arc<[usize]>)>);

impl Seen {
    /// The CPUs of `dev`: what was found less than [`TRUST`] before `now`, or else what
    /// `look` finds, kept from `now` on.
    fn get(&mut self, dev: u64, now: Instant, look: impl FnOnce() -> Arc<[usize]>) -> Arc<[usize]> {
        match self.0.get(&dev) {
            Some((at, cpus)) if now.saturating_duration_since(*at) < TRUST => cpus.clone(),
            _ => {
                let cpus = look();
                self.0.insert(dev, (now, cpus.clone()));
                cpus
            }
        }
    }
}

/// Where sysfs and procfs are mounted (`/sys` and `/proc`; a directory tree in tests).
struct Roots {
    sys: PathBuf,
    proc: PathBuf,
}

impl Roots {
    /// The machine's own.
    fn system() -> Self {
        Roots {
            sys: PathBuf::from("/sys"),
            proc: PathBuf::from("/proc"),
        }
    }

    fn completion_cpus(&self, major: u32, minor: u32) -> Vec<InterruptCpu> {
        if major == 0 {
            // Anonymous device numbers: no block device behind them.
            return Vec::new();
        }
        let Ok(block) =
            std::fs::canonicalize(self.sys.join("dev/block").join(format!("{major}:{minor}")))
        else {
            return Vec::new();
        };
        let mut disks = Vec::new();
        self.disks_under(&block, &mut disks, 0);
        let mut irqs: Vec<u32> = disks.iter().flat_map(|d| self.irqs_of(d)).collect();
        irqs.sort_unstable();
        irqs.dedup();
        if irqs.is_empty() {
            return Vec::new();
        }
        let table = self.counts(&irqs);
        let vector_total = |irq: &u32| table.get(irq).map_or(0, |c| c.values().sum::<u64>());
        let total: u64 = irqs.iter().map(vector_total).sum();
        // The vectors that carry completions: each with at least 1% of the device's interrupts
        // (a configuration vector takes a handful), or every vector before any has fired.
        let carrying: Vec<u32> = irqs
            .iter()
            .copied()
            .filter(|irq| total == 0 || vector_total(irq).saturating_mul(100) >= total)
            .collect();
        let mut taken: BTreeMap<usize, u64> = BTreeMap::new();
        for irq in &carrying {
            for (&cpu, &n) in table.get(irq).into_iter().flatten() {
                *taken.entry(cpu).or_insert(0) += n;
            }
        }
        // Where those vectors are routed now; since-boot counts would still name a CPU that
        // irqbalance (or an administrator) has moved a vector away from.
        let mut cpus: BTreeSet<usize> = carrying.iter().flat_map(|&irq| self.routed(irq)).collect();
        if cpus.is_empty() {
            // The routing cannot be read: the CPUs that took a real share.
            let carried: u64 = taken.values().sum();
            cpus = taken
                .iter()
                .filter(|&(_, &n)| n > 0 && n.saturating_mul(100) >= carried)
                .map(|(&cpu, _)| cpu)
                .collect();
        }
        let mut out: Vec<InterruptCpu> = cpus
            .into_iter()
            .map(|cpu| InterruptCpu {
                cpu,
                count: taken.get(&cpu).copied().unwrap_or(0),
            })
            .collect();
        // Busiest first; equal counts by CPU number.
        out.sort_by(|a, b| b.count.cmp(&a.count).then(a.cpu.cmp(&b.cpu)));
        out
    }

    /// The CPUs interrupt `irq` is delivered to now (`effective_affinity_list`); empty when
    /// the kernel does not say.
    fn routed(&self, irq: u32) -> Vec<usize> {
        std::fs::read_to_string(
            self.proc
                .join("irq")
                .join(irq.to_string())
                .join("effective_affinity_list"),
        )
        .map(|list| parse_cpu_list(list.trim()))
        .unwrap_or_default()
    }

    /// The whole disks under the block device at `block` (its sysfs directory): itself, its
    /// parent for a partition, the disks under it for a stacked device. `depth` stops a cycle.
    fn disks_under(&self, block: &Path, out: &mut Vec<PathBuf>, depth: usize) {
        if depth > 8 {
            return;
        }
        let disk = if block.join("partition").exists() {
            match block.parent() {
                Some(p) => p.to_owned(),
                None => return,
            }
        } else {
            block.to_owned()
        };
        let slaves: Vec<PathBuf> = std::fs::read_dir(disk.join("slaves"))
            .map(|dir| {
                dir.filter_map(Result::ok)
                    .filter_map(|e| std::fs::canonicalize(e.path()).ok())
                    .collect()
            })
            .unwrap_or_default();
        if slaves.is_empty() {
            out.push(disk);
        } else {
            for s in slaves {
                self.disks_under(&s, out, depth + 1);
            }
        }
    }

    /// The interrupt numbers of the PCI function a disk hangs under: its MSI/MSI-X vectors, or
    /// its legacy line when it has none.
    fn irqs_of(&self, disk: &Path) -> Vec<u32> {
        let Ok(mut dir) = std::fs::canonicalize(disk.join("device")) else {
            return Vec::new();
        };
        let devices = self.sys.join("devices");
        while dir.starts_with(&devices) && dir != devices {
            if let Ok(msi) = std::fs::read_dir(dir.join("msi_irqs")) {
                let irqs: Vec<u32> = msi
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .collect();
                if !irqs.is_empty() {
                    return irqs;
                }
            }
            if dir.join("vendor").exists() && dir.join("class").exists() {
                // A PCI function without MSI: its one line (0 when it has none).
                return std::fs::read_to_string(dir.join("irq"))
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .filter(|&irq: &u32| irq != 0)
                    .into_iter()
                    .collect();
            }
            if !dir.pop() {
                break;
            }
        }
        Vec::new()
    }

    /// Each of `irqs`' (sorted) interrupts per CPU since boot, from `/proc/interrupts`.
    fn counts(&self, irqs: &[u32]) -> BTreeMap<u32, BTreeMap<usize, u64>> {
        let mut table = BTreeMap::new();
        let Ok(text) = std::fs::read_to_string(self.proc.join("interrupts")) else {
            return table;
        };
        let mut lines = text.lines();
        let cpus: Vec<usize> = lines
            .next()
            .unwrap_or("")
            .split_whitespace()
            .filter_map(|c| c.strip_prefix("CPU")?.parse().ok())
            .collect();
        for line in lines {
            let Some((irq, rest)) = line.trim_start().split_once(':') else {
                continue;
            };
            let Ok(irq) = irq.parse::<u32>() else {
                continue;
            };
            if irqs.binary_search(&irq).is_err() {
                continue;
            }
            let row: &mut BTreeMap<usize, u64> = table.entry(irq).or_default();
            for (&cpu, n) in cpus.iter().zip(rest.split_whitespace()) {
                let Ok(n) = n.parse::<u64>() else { break };
                *row.entry(cpu).or_insert(0) += n;
            }
        }
        table
    }
}

/// A kernel CPU list ("0-3,8,10-11"); malformed parts are skipped.
fn parse_cpu_list(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    if a <= b && b - a < 1 << 16 {
                        cpus.extend(a..=b);
                    }
                }
            }
            None => cpus.extend(part.parse::<usize>().ok()),
        }
    }
    cpus
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    /// A sysfs and procfs tree: `vda` (partition `vda1`) under PCI function 0000:00:02.0 with
    /// MSI-X vectors 35 (config) and 36 (requests), routed as `routes` says (a vector left out
    /// has no `effective_affinity_list`), and `loop0` under no PCI function.
    fn machine(interrupts: &str, routes: &[(&str, &str)]) -> (tempfile::TempDir, Roots) {
        let t = tempfile::tempdir().unwrap();
        let sys = t.path().join("sys");
        let proc = t.path().join("proc");
        let pci = sys.join("devices/pci0000:00/0000:00:02.0");
        let vda = pci.join("virtio1/block/vda");
        fs::create_dir_all(vda.join("vda1")).unwrap();
        fs::write(vda.join("vda1/partition"), "1\n").unwrap();
        symlink("../..", vda.join("device")).unwrap();
        for f in ["vendor", "class"] {
            fs::write(pci.join(f), "0x1af4\n").unwrap();
        }
        fs::create_dir_all(pci.join("msi_irqs")).unwrap();
        for irq in ["35", "36"] {
            fs::write(pci.join("msi_irqs").join(irq), "msix\n").unwrap();
        }
        let loop0 = sys.join("devices/virtual/block/loop0");
        fs::create_dir_all(&loop0).unwrap();
        let dm = sys.join("devices/virtual/block/dm-0");
        fs::create_dir_all(dm.join("slaves")).unwrap();
        symlink(vda.join("vda1"), dm.join("slaves/vda1")).unwrap();
        fs::create_dir_all(sys.join("dev/block")).unwrap();
        symlink(&vda, sys.join("dev/block/253:0")).unwrap();
        symlink(vda.join("vda1"), sys.join("dev/block/253:1")).unwrap();
        symlink(&loop0, sys.join("dev/block/7:0")).unwrap();
        symlink(&dm, sys.join("dev/block/252:0")).unwrap();
        for (irq, list) in routes {
            let dir = proc.join("irq").join(irq);
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("effective_affinity_list"), format!("{list}\n")).unwrap();
        }
        fs::create_dir_all(&proc).unwrap();
        fs::write(proc.join("interrupts"), interrupts).unwrap();
        (t, Roots { sys, proc })
    }

    /// The shape of this project's VM: both vectors on CPU 1.
    const ON_CPU1: &[(&str, &str)] = &[("35", "1"), ("36", "1")];

    const BUSY: &str = "           CPU0       CPU1       CPU2\n\
         35:          0          1          0  PCI-MSIX-0000:00:02.0   0-edge      virtio1-config\n\
         36:       2000    5000000          0  PCI-MSIX-0000:00:02.0   1-edge      virtio1-req.0\n\
         41:    9999999          0          0  PCI-MSIX-0000:00:04.0   1-edge      virtio3-rx\n\
        NMI:          0          0          0   Non-maskable interrupts\n";

    fn cpus(found: Vec<InterruptCpu>) -> Vec<(usize, u64)> {
        found.iter().map(|c| (c.cpu, c.count)).collect()
    }

    #[test]
    fn a_partition_counts_as_its_disk_and_the_busiest_cpu_comes_first() {
        let (_t, roots) = machine(BUSY, ON_CPU1);
        // Vector 36 carries the completions and is routed to CPU 1; the config vector's one
        // interrupt is not counted, nor the network's vector 41.
        assert_eq!(cpus(roots.completion_cpus(253, 1)), vec![(1, 5_000_000)]);
        assert_eq!(cpus(roots.completion_cpus(253, 0)), vec![(1, 5_000_000)]);
    }

    #[test]
    fn a_stacked_device_counts_the_disks_under_it() {
        let (_t, roots) = machine(BUSY, ON_CPU1);
        assert_eq!(cpus(roots.completion_cpus(252, 0)), vec![(1, 5_000_000)]);
    }

    #[test]
    fn a_vector_moved_elsewhere_counts_where_it_goes_now() {
        // Five million interrupts on CPU 1 since boot, but the vector now goes to CPU 2.
        let (_t, roots) = machine(BUSY, &[("35", "1"), ("36", "2")]);
        assert_eq!(cpus(roots.completion_cpus(253, 1)), vec![(2, 0)]);
    }

    #[test]
    fn every_cpu_a_completion_vector_goes_to_is_listed_busiest_first() {
        let (_t, roots) = machine(
            "      CPU0  CPU1\n 35: 0 0 PCI-MSIX\n 36: 300 700 PCI-MSIX virtio1-req.0\n",
            &[("35", "0"), ("36", "0-1")],
        );
        assert_eq!(
            cpus(roots.completion_cpus(253, 1)),
            vec![(1, 700), (0, 300)]
        );
    }

    #[test]
    fn a_device_with_no_interrupts_yet_gives_where_its_vectors_are_routed() {
        let (_t, roots) = machine(
            "      CPU0  CPU1\n 35: 0 0 x\n 36: 0 0 x\n",
            &[("35", "1"), ("36", "0")],
        );
        assert_eq!(cpus(roots.completion_cpus(253, 1)), vec![(0, 0), (1, 0)]);
    }

    #[test]
    fn without_the_routing_the_cpus_that_took_a_real_share_are_listed() {
        let (_t, roots) = machine(BUSY, &[]);
        // CPU 0's 2,000 of vector 36's 5,002,000 are under 1%.
        assert_eq!(cpus(roots.completion_cpus(253, 1)), vec![(1, 5_000_000)]);
        let (_t, roots) = machine("      CPU0  CPU1\n 35: 0 0 x\n 36: 300 700 x\n", &[]);
        assert_eq!(
            cpus(roots.completion_cpus(253, 1)),
            vec![(1, 700), (0, 300)]
        );
    }

    #[test]
    fn a_device_without_a_pci_function_or_number_gives_nothing() {
        let (_t, roots) = machine(BUSY, ON_CPU1);
        assert!(roots.completion_cpus(7, 0).is_empty(), "loop device");
        assert!(roots.completion_cpus(0, 45).is_empty(), "anonymous device");
        assert!(roots.completion_cpus(8, 0).is_empty(), "no such device");
    }

    #[test]
    fn a_device_is_looked_up_again_only_after_the_trust_has_run_out() {
        let mut seen = Seen::default();
        let t = Instant::now();
        let looks = std::cell::Cell::new(0);
        let look = |cpus: &[usize]| {
            looks.set(looks.get() + 1);
            Arc::from(cpus)
        };
        assert_eq!(&*seen.get(1, t, || look(&[1])), &[1]);
        // Within the trust: what was found, however the routing moved meanwhile.
        let later = t + TRUST - Duration::from_millis(1);
        assert_eq!(&*seen.get(1, later, || look(&[0])), &[1]);
        // Another device is looked up on its own.
        assert_eq!(&*seen.get(2, later, || look(&[])), &[] as &[usize]);
        assert_eq!(looks.get(), 2);
        // A reading before the lookup (another thread's clock read) trusts it too.
        assert_eq!(&*seen.get(1, t, || look(&[0])), &[1]);
        assert_eq!(looks.get(), 2);
        // At the end of the trust the routing is read again, and trusted from then.
        assert_eq!(&*seen.get(1, t + TRUST, || look(&[0])), &[0]);
        assert_eq!(&*seen.get(1, t + TRUST + TRUST / 2, || look(&[1])), &[0]);
        assert_eq!(looks.get(), 3);
    }

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("1"), vec![1]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("3-1,x,2"), vec![2]);
    }

    #[test]
    fn this_machines_answer_names_only_its_cpus() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpus = completion_cpus(std::env::temp_dir()).unwrap();
        let total = fs::read_to_string("/proc/interrupts")
            .ok()
            .and_then(|t| t.lines().next().map(|l| l.split_whitespace().count()))
            .unwrap_or(n);
        for c in &cpus {
            assert!(c.cpu < total.max(n), "{c:?} of {total} CPUs");
        }
        assert!(
            cpus.windows(2).all(|w| w[0].count >= w[1].count),
            "busiest first: {cpus:?}"
        );
    }
}
