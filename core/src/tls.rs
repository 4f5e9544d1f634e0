//! TLS clients (`rediss://`, `amqps://`, the sidecar's PostgreSQL): whose
//! certificates the peer's must chain to.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// The TLS client configuration: the authorities of `ca_file`, or the
/// system's. `setting` names where the file is given, for the errors.
pub fn client_config(setting: &str, ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = roots(setting, ca_file)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The authorities of `ca_file` (PEM), or the system's.
pub fn roots(setting: &str, ca_file: Option<&Path>) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            let unusable = |e: String| format!("unusable {setting} {}: {e}", path.display());
            let pem =
                std::fs::read(path).map_err(|e| format!("cannot read {setting} {}: {e}", path.display()))?;
            for certificate in CertificateDer::pem_slice_iter(&pem) {
                roots
                    .add(certificate.map_err(|e| unusable(e.to_string()))?)
                    .map_err(|e| unusable(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(unusable("no certificate in it".into()));
            }
        }
        None => {
            let (added, _) = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if added == 0 {
                return Err(format!("no system certificate authorities found for TLS; set {setting}"));
            }
        }
    }
    Ok(roots)
}
