//! Certificates made at test time, for TLS tests against private servers:
//! [`TestCertificates`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use super::cluster::ClusterError;
use super::host::{self, io};

/// Where every set of certificates lives: `<BASE>-<pid>-<n>`.
const BASE: &str = "/tmp/idemq-kit-certs";

/// A certificate and its private key, as PEM files.
#[derive(Debug, Clone)]
pub struct CertifiedKey {
    cert: PathBuf,
    key: PathBuf,
}

impl CertifiedKey {
    /// The certificate (PEM).
    pub fn cert(&self) -> &Path {
        &self.cert
    }

    /// Its private key (PEM, PKCS#8).
    pub fn key(&self) -> &Path {
        &self.key
    }
}

/// A test certificate authority and what it signed, as PEM files in a directory of
/// their own (removed on drop; a killed run's are removed by the next):
///
/// | file | what |
/// |---|---|
/// | [`ca`](Self::ca) | the CA that signed everything below |
/// | [`other_ca`](Self::other_ca) | a CA that signed nothing here: trusting it alone, no server verifies |
/// | [`server`](Self::server) | a server certificate for `localhost` (not `127.0.0.1`) |
/// | [`expired`](Self::expired) | a server certificate for `localhost` and `expired.localhost`, expired in 2021 |
/// | [`other_host`](Self::other_host) | a server certificate for `elsewhere.invalid` only |
/// | [`client`](Self::client) | a client certificate, common name `postgres` (PostgreSQL's `clientcert=verify-full` matches it to the user) |
///
/// Every file is readable by all (the private servers run as other users); the keys
/// are test keys and nothing else.
#[derive(Debug)]
pub struct TestCertificates {
    dir: PathBuf,
    /// Removes the directory when this process ends, however it ends.
    watchdog: std::process::Child,
    ca: PathBuf,
    other_ca: PathBuf,
    server: CertifiedKey,
    expired: CertifiedKey,
    other_host: CertifiedKey,
    client: CertifiedKey,
}

impl TestCertificates {
    /// Makes a fresh CA and its certificates.
    ///
    /// # Errors
    /// A file cannot be written, or a certificate cannot be made.
    pub fn generate() -> Result<Self, ClusterError> {
        static N: AtomicU64 = AtomicU64::new(0);
        remove_stale();
        let dir =
            PathBuf::from(format!("{BASE}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|source| io(&format!("create {}", dir.display()), source))?;
        set_mode(&dir, 0o755)?;
        let watchdog = watchdog(&dir)?;
        let certs = Self {
            watchdog,
            ca: dir.join("ca.pem"),
            other_ca: dir.join("other-ca.pem"),
            server: pair(&dir, "server"),
            expired: pair(&dir, "expired"),
            other_host: pair(&dir, "other-host"),
            client: pair(&dir, "client"),
            dir,
        };
        // From here on a failure drops `certs`, which removes the directory.
        certs.write().map_err(|err| match err {
            Made::Io(err) => err,
            Made::Rcgen(err) => ClusterError::Command { command: "rcgen".into(), output: err.to_string() },
        })?;
        Ok(certs)
    }

    fn write(&self) -> Result<(), Made> {
        let (ca_params, ca_key) = authority("idemq test CA")?;
        self.put(&self.ca, &ca_params.self_signed(&ca_key)?.pem())?;
        let (other_params, other_key) = authority("idemq other test CA")?;
        self.put(&self.other_ca, &other_params.self_signed(&other_key)?.pem())?;
        let issuer = Issuer::new(ca_params, ca_key);

        let server = leaf(&["localhost"], "localhost", ExtendedKeyUsagePurpose::ServerAuth)?;
        self.sign(&self.server, server, &issuer)?;
        let mut expired =
            leaf(&["localhost", "expired.localhost"], "localhost", ExtendedKeyUsagePurpose::ServerAuth)?;
        expired.not_before = rcgen::date_time_ymd(2020, 1, 1);
        expired.not_after = rcgen::date_time_ymd(2021, 1, 1);
        self.sign(&self.expired, expired, &issuer)?;
        let other = leaf(&["elsewhere.invalid"], "elsewhere.invalid", ExtendedKeyUsagePurpose::ServerAuth)?;
        self.sign(&self.other_host, other, &issuer)?;
        let client = leaf(&[], "postgres", ExtendedKeyUsagePurpose::ClientAuth)?;
        self.sign(&self.client, client, &issuer)?;
        Ok(())
    }

    fn sign(
        &self,
        to: &CertifiedKey,
        params: CertificateParams,
        issuer: &Issuer<'_, KeyPair>,
    ) -> Result<(), Made> {
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, issuer)?;
        self.put(&to.cert, &cert.pem())?;
        self.put(&to.key, &key.serialize_pem())?;
        Ok(())
    }

    fn put(&self, path: &Path, text: &str) -> Result<(), Made> {
        std::fs::write(path, text)
            .map_err(|source| Made::Io(io(&format!("write {}", path.display()), source)))?;
        set_mode(path, 0o644).map_err(Made::Io)
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate (PEM): what clients trust (`cacertfile=`, `sslrootcert=`).
    pub fn ca(&self) -> &Path {
        &self.ca
    }

    /// Another CA's certificate, which signed nothing here.
    pub fn other_ca(&self) -> &Path {
        &self.other_ca
    }

    /// The server certificate for `localhost`.
    pub fn server(&self) -> &CertifiedKey {
        &self.server
    }

    /// A server certificate for `localhost` and `expired.localhost` that expired
    /// on 2021-01-01.
    pub fn expired(&self) -> &CertifiedKey {
        &self.expired
    }

    /// A server certificate for `elsewhere.invalid` only.
    pub fn other_host(&self) -> &CertifiedKey {
        &self.other_host
    }

    /// The client certificate (common name `postgres`).
    pub fn client(&self) -> &CertifiedKey {
        &self.client
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = self.watchdog.kill();
        let _ = self.watchdog.wait();
    }
}

/// A process of its own that removes `dir` once this process has ended (a set kept
/// in a `static` is never dropped).
fn watchdog(dir: &Path) -> Result<std::process::Child, ClusterError> {
    host::watchdog(&format!("rm -rf {}", dir.display()), "the certificates")
}

/// Why making the files failed.
enum Made {
    Io(ClusterError),
    Rcgen(rcgen::Error),
}

impl From<rcgen::Error> for Made {
    fn from(err: rcgen::Error) -> Self {
        Self::Rcgen(err)
    }
}

fn pair(dir: &Path, name: &str) -> CertifiedKey {
    CertifiedKey { cert: dir.join(format!("{name}.pem")), key: dir.join(format!("{name}.key")) }
}

fn authority(name: &str) -> Result<(CertificateParams, KeyPair), Made> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok((params, KeyPair::generate()?))
}

fn leaf(
    names: &[&str],
    common_name: &str,
    purpose: ExtendedKeyUsagePurpose,
) -> Result<CertificateParams, Made> {
    let mut params = CertificateParams::new(names.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>())?;
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![purpose];
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

fn set_mode(path: &Path, mode: u32) -> Result<(), ClusterError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|source| io(&format!("chmod {}", path.display()), source))
}

/// Removes the directories of runs whose process is gone.
fn remove_stale() {
    for dir in host::stale_dirs(BASE) {
        let _ = std::fs::remove_dir_all(dir);
    }
}
