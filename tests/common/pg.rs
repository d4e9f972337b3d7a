//! A throwaway PostgreSQL cluster for tests: the system's `initdb` and `postgres` binaries, a
//! data directory in a temp dir, a free port on 127.0.0.1, stopped (and deleted) on drop.
//!
//! No mocks, no docker, no downloads. When the binaries are missing the tests that need them
//! print a loud `SKIPPED` line and return; with `CI=true` a missing binary is a failure.
//! Binaries are looked up in `$IOTHROTTLE_PG_BIN`, then `/usr/lib/postgresql/<newest>/bin`,
//! then `$PATH`. `initdb` refuses to run as root: as root the cluster runs as the `postgres`
//! user (created by Debian's package).

use std::fs;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running throwaway cluster.
pub struct PgCluster {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    owner: Option<(u32, u32)>,
    /// Extra `-c name=value` server settings, kept across restarts.
    settings: Vec<(String, String)>,
    child: Option<Child>,
    // Declared last: removed after the server has stopped.
    _dir: tempfile::TempDir,
}

/// Starts a cluster, or returns `None` after printing why the test is skipped.
///
/// Panics when the binaries are missing and `CI=true`, or when a cluster cannot be started.
pub fn cluster_or_skip(test: &str) -> Option<PgCluster> {
    cluster_with_settings_or_skip(test, &[])
}

/// [`cluster_or_skip`] with extra server settings (`-c name=value`), e.g.
/// `("synchronous_commit", "off")`; they stay in force across restarts.
pub fn cluster_with_settings_or_skip(test: &str, settings: &[(&str, &str)]) -> Option<PgCluster> {
    cluster_with_files_or_skip(test, settings, &[])
}

/// [`cluster_with_settings_or_skip`] with files written into the data directory before the
/// server starts (owned by the server's user, mode 0600), e.g. `server.crt` and `server.key`
/// for `ssl=on`; settings name them relative to the data directory.
pub fn cluster_with_files_or_skip(
    test: &str,
    settings: &[(&str, &str)],
    files: &[(&str, &[u8])],
) -> Option<PgCluster> {
    let settings: Vec<(String, String)> = settings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    match find_bin() {
        Some(bin) => {
            Some(PgCluster::start(bin, settings, files).unwrap_or_else(|e| panic!("{test}: {e}")))
        }
        None => {
            let msg = format!(
                "{test}: PostgreSQL binaries (initdb, postgres) not found in $IOTHROTTLE_PG_BIN, \
                 /usr/lib/postgresql/*/bin or $PATH"
            );
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{msg}; CI=true requires them (apt-get install -y postgresql)");
            }
            eprintln!("\n!!!!!!!! SKIPPED !!!!!!!! {msg}\n");
            None
        }
    }
}

fn find_bin() -> Option<PathBuf> {
    let ok = |d: &Path| d.join("initdb").is_file() && d.join("postgres").is_file();
    if let Some(d) = std::env::var_os("IOTHROTTLE_PG_BIN").map(PathBuf::from) {
        return ok(&d).then_some(d);
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, d)| ok(d))
        .collect();
    versions.sort();
    if let Some((_, d)) = versions.pop() {
        return Some(d);
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .find(|d| ok(d))
}

/// `(uid, gid)` of the `postgres` user, from /etc/passwd.
fn postgres_user() -> Result<(u32, u32), String> {
    let passwd = fs::read_to_string("/etc/passwd").map_err(|e| format!("/etc/passwd: {e}"))?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&"postgres") && f.len() > 3)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .ok_or_else(|| "running as root and there is no `postgres` user to run the cluster".into())
}

fn is_root() -> bool {
    // The owner of a file we just created is our effective uid.
    let probe = tempfile::NamedTempFile::new().expect("temp file");
    std::os::unix::fs::MetadataExt::uid(&probe.as_file().metadata().expect("metadata")) == 0
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

impl PgCluster {
    fn start(
        bin: PathBuf,
        settings: Vec<(String, String)>,
        files: &[(&str, &[u8])],
    ) -> Result<PgCluster, String> {
        let dir = tempfile::Builder::new()
            .prefix("iothrottle-pg-")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let owner = if is_root() {
            Some(postgres_user()?)
        } else {
            None
        };
        let data = dir.path().join("data");
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .map_err(|e| format!("chown temp dir: {e}"))?;
        }
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("chmod temp dir: {e}"))?;
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .args(["-D"])
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .stdin(Stdio::null());
        run_as(&mut initdb, owner);
        let out = initdb
            .output()
            .map_err(|e| format!("running initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        for (name, bytes) in files {
            let path = data.join(name);
            fs::write(&path, bytes).map_err(|e| format!("writing {name}: {e}"))?;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
                .map_err(|e| format!("chmod {name}: {e}"))?;
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                    .map_err(|e| format!("chown {name}: {e}"))?;
            }
        }
        let mut pg = PgCluster {
            bin,
            data,
            port: free_port(),
            owner,
            settings,
            child: None,
            _dir: dir,
        };
        pg.launch()?;
        Ok(pg)
    }

    fn launch(&mut self) -> Result<(), String> {
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(&self.data)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self._dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(["-c", "max_connections=200"])
            .args(
                self.settings
                    .iter()
                    .flat_map(|(k, v)| ["-c".to_string(), format!("{k}={v}")]),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        run_as(&mut cmd, self.owner);
        let mut child = cmd.spawn().map_err(|e| format!("starting postgres: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // An open port is not enough: during startup (and crash recovery) the server
            // refuses sessions with 57P03 "the database system is starting up".
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() && self.is_ready() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                return Err(format!("postgres exited with {status}: {err}"));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err("postgres did not accept connections within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        Ok(())
    }

    /// Whether the server accepts sessions (`pg_isready`; falls back to `true` without it).
    fn is_ready(&self) -> bool {
        let tool = self.bin.join("pg_isready");
        if !tool.is_file() {
            return true;
        }
        Command::new(tool)
            .args([
                "-q",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// `host=127.0.0.1 port=… user=postgres dbname=postgres`, for `tokio_postgres::connect`.
    pub fn connection_string(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// The same as a URL: `postgresql://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The connection string of another role (`user=NAME`); the cluster trusts every local
    /// connection (`-A trust`), so no password is needed.
    pub fn connection_string_as(&self, user: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} dbname=postgres",
            self.port
        )
    }

    /// The data directory (owned by the server's user).
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the server with a fast shutdown (SIGINT): clients are disconnected.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server with SIGKILL (a crash: no shutdown checkpoint).
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            // Children of the postmaster notice its death and exit; give them a moment to
            // release the shared memory before a restart.
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Starts the server again on the same port and data directory.
    pub fn start_again(&mut self) -> Result<(), String> {
        if self.child.is_some() {
            return Ok(());
        }
        self.launch()
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }
}

fn run_as(cmd: &mut Command, owner: Option<(u32, u32)>) {
    if let Some((uid, gid)) = owner {
        cmd.uid(uid).gid(gid);
        // Keep HOME and locale harmless for the postgres user.
        cmd.env("HOME", "/tmp").env("LC_ALL", "C.UTF-8");
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An error's message followed by every cause's, joined by `": "` (what `anyhow` prints with
/// `{:#}`): the driver's and the TLS library's reasons are causes, not part of `Display`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}
