//! Egress policy: where the daemon may send HTTP requests on behalf of a
//! session (HTTP MCP servers here, webhook deliveries elsewhere).
//!
//! A [`Policy`] is built from configured destinations: host names (with
//! or without a port), IP literals and CIDR blocks. [`Policy::check`]
//! vets a URL before it is used; [`Policy::client`] builds a
//! `reqwest::Client` that never follows redirects, ignores proxy
//! settings, and resolves names itself, keeping only addresses the policy
//! allows. Because the connection is made to exactly the addresses the
//! resolver returned, a name cannot be re-pointed at an internal address
//! between the check and the connection (DNS rebinding).
//!
//! Public unicast addresses are allowed for a listed name. Special
//! addresses (loopback, private, link-local, carrier-grade NAT,
//! unique-local, multicast, documentation, ..., and IPv4-mapped or
//! embedded forms of those; see [`special_purpose`]) are allowed only
//! when that address, or a CIDR containing it, is listed.
//!
//! Always call [`Policy::check`] before sending: the client's resolver
//! sees only names, so an IP-literal URL is vetted by `check` alone.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use url::{Host, Url};

/// Where requests may go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// The allowed destinations, parsed.
    entries: Vec<Entry>,
    /// The setting the destinations come from, named in errors so people
    /// know what to change (e.g. `tools.mcp.allowed_hosts`).
    setting: Option<String>,
}

/// One allowed destination.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    /// A host name (lowercase, no trailing dot), on any port or one.
    Host { name: String, port: Option<u16> },
    /// An IP address, on any port or one.
    Ip { addr: IpAddr, port: Option<u16> },
    /// A block of addresses, any port.
    Net(IpNet),
}

impl Policy {
    /// A policy allowing `allowed`: `"host"`, `"host:port"`, IP literals
    /// (`"127.0.0.1"`, `"::1"`, `"[::1]:8080"`, `"10.0.0.1:80"`) and CIDR
    /// blocks (`"10.0.0.0/8"`). A bad entry is an error naming it.
    pub fn new(allowed: &[String]) -> Result<Policy, String> {
        let entries = allowed
            .iter()
            .map(|e| parse_entry(e))
            .collect::<Result<_, _>>()?;
        Ok(Policy {
            entries,
            setting: None,
        })
    }

    /// Names the setting the destinations come from, for error messages.
    pub fn for_setting(mut self, setting: impl Into<String>) -> Policy {
        self.setting = Some(setting.into());
        self
    }

    /// Whether nothing is allowed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn setting(&self) -> &str {
        self.setting
            .as_deref()
            .unwrap_or("the allowed destinations")
    }

    /// Vets `url`: http or https, and a host (with its port) that is
    /// listed. An IP-literal host must be a listed address or inside a
    /// listed block. Errors name the URL without credentials or query.
    pub fn check(&self, url: &str) -> Result<Url, String> {
        let parsed =
            Url::parse(url).map_err(|e| format!("`{}` is not a valid URL: {e}", redact(url)))?;
        let shown = redact(url);
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!(
                "`{shown}`: only http and https URLs are allowed, not `{}`",
                parsed.scheme()
            ));
        }
        let port = parsed
            .port_or_known_default()
            .ok_or_else(|| format!("`{shown}` has no port"))?;
        let listed = match parsed.host() {
            None => return Err(format!("`{shown}` has no host")),
            Some(Host::Domain(d)) => {
                let d = normalize_name(d);
                self.entries.iter().any(|e| match e {
                    Entry::Host { name, port: p } => *name == d && p.is_none_or(|p| p == port),
                    _ => false,
                })
            }
            Some(Host::Ipv4(ip)) => self.lists_ip(IpAddr::V4(ip), Some(port)),
            Some(Host::Ipv6(ip)) => self.lists_ip(IpAddr::V6(ip), Some(port)),
        };
        if !listed {
            let host = parsed.host_str().unwrap_or_default();
            return Err(format!(
                "`{shown}`: {host} (port {port}) is not in {}; add `{host}` or `{host}:{port}` there to allow it",
                self.setting()
            ));
        }
        Ok(parsed)
    }

    /// Whether `ip` is listed (as an address, or inside a block). With
    /// `port`, an entry naming a port must name that one; without (an
    /// address a listed name resolved to, whose port the resolver does not
    /// see), only entries on any port count, so `127.0.0.1:9000` never
    /// opens every loopback port to a name. IPv4-mapped IPv6 addresses
    /// match their IPv4 entries.
    fn lists_ip(&self, ip: IpAddr, port: Option<u16>) -> bool {
        let canon = ip.to_canonical();
        self.entries.iter().any(|e| match e {
            Entry::Ip { addr, port: p } => {
                (*addr == ip || *addr == canon)
                    && match (p, port) {
                        (None, _) => true,
                        (Some(p), Some(port)) => *p == port,
                        (Some(_), None) => false,
                    }
            }
            Entry::Net(net) => net.contains(&ip) || net.contains(&canon),
            Entry::Host { .. } => false,
        })
    }

    /// Whether a connection to `ip` is allowed for a listed name: public
    /// unicast addresses are; special ones only when listed.
    pub fn allows_address(&self, ip: IpAddr) -> bool {
        special_purpose(ip).is_none() || self.lists_ip(ip, None)
    }

    /// Resolves `host` (a listed name) and keeps the addresses the policy
    /// allows. When none survives, the error says which addresses were
    /// refused and why.
    pub async fn resolve(&self, host: &str) -> Result<Vec<IpAddr>, String> {
        let name = normalize_name(host);
        let listed = self
            .entries
            .iter()
            .any(|e| matches!(e, Entry::Host { name: n, .. } if *n == name));
        if !listed {
            return Err(format!(
                "`{name}` is not in {}; add it there to allow it",
                self.setting()
            ));
        }
        let addrs: Vec<IpAddr> = tokio::net::lookup_host((name.as_str(), 0))
            .await
            .map_err(|e| format!("cannot resolve `{name}`: {e}"))?
            .map(|a| a.ip())
            .collect();
        let (ok, refused): (Vec<IpAddr>, Vec<IpAddr>) =
            addrs.iter().partition(|ip| self.allows_address(**ip));
        if ok.is_empty() {
            let why: Vec<String> = refused
                .iter()
                .map(|ip| {
                    format!(
                        "{ip}, which is {}",
                        special_purpose(*ip).unwrap_or("refused")
                    )
                })
                .collect();
            return Err(if why.is_empty() {
                format!("`{name}` resolves to no address")
            } else {
                format!(
                    "`{name}` resolves to {}; list the address (or a CIDR containing it) in {} to allow it",
                    why.join(", and "),
                    self.setting()
                )
            });
        }
        Ok(ok)
    }

    /// A client builder with the policy's safety settings: no redirects,
    /// no proxy, and the policy's resolver. Callers add timeouts; they
    /// must not replace the resolver or the redirect policy.
    pub fn client_builder(&self) -> reqwest::ClientBuilder {
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(Resolver {
                policy: Arc::new(self.clone()),
            }))
    }

    /// A client for the policy (see [`Policy::client_builder`]) bounding
    /// each request, connection included, by `timeout`.
    ///
    /// # Panics
    ///
    /// Like `reqwest::Client::new`, when the TLS backend cannot be
    /// initialized.
    pub fn client(&self, timeout: Duration) -> reqwest::Client {
        self.client_builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()
            .expect("the TLS backend initializes")
    }
}

/// The resolver of a policy's clients.
struct Resolver {
    /// Decides which names and addresses are allowed.
    policy: Arc<Policy>,
}

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let ips = policy.resolve(&host).await?;
            let addrs: reqwest::dns::Addrs =
                Box::new(ips.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

fn normalize_name(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn parse_entry(entry: &str) -> Result<Entry, String> {
    let e = entry.trim();
    let bad = |why: &str| {
        format!(
            "bad allowed destination `{entry}`: {why}; give a host, host:port, IP address, [IPv6]:port or CIDR block"
        )
    };
    if e.is_empty() {
        return Err(bad("it is empty"));
    }
    if e.contains("://") {
        return Err(bad("it has a scheme"));
    }
    if e.contains('/') {
        return e
            .parse::<IpNet>()
            .map(|n| Entry::Net(n.trunc()))
            .map_err(|err| bad(&format!("not a CIDR block ({err})")));
    }
    if let Ok(addr) = e.parse::<IpAddr>() {
        return Ok(Entry::Ip { addr, port: None });
    }
    if let Ok(sa) = e.parse::<SocketAddr>() {
        return Ok(Entry::Ip {
            addr: sa.ip(),
            port: Some(sa.port()),
        });
    }
    if e.starts_with('[') {
        return Err(bad("not an [IPv6]:port"));
    }
    let (name, port) = match e.rsplit_once(':') {
        Some((n, p)) => (
            n,
            Some(
                p.parse::<u16>()
                    .map_err(|_| bad(&format!("`{p}` is not a port")))?,
            ),
        ),
        None => (e, None),
    };
    let name = normalize_name(name);
    let valid = !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        });
    if !valid {
        return Err(bad("not a host name"));
    }
    Ok(Entry::Host { name, port })
}

/// Why `ip` is not a public unicast address (e.g. `"loopback"`), or
/// `None` when it is one. IPv4-mapped, IPv4-compatible, NAT64 and 6to4
/// IPv6 addresses are judged by the IPv4 address they carry.
pub fn special_purpose(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => special_v6(v6),
    }
}

fn in_v4(ip: Ipv4Addr, net: [u8; 4], len: u8) -> bool {
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    u32::from(ip) & mask == u32::from(Ipv4Addr::from(net)) & mask
}

fn special_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let table: &[([u8; 4], u8, &'static str)] = &[
        ([0, 0, 0, 0], 32, "unspecified"),
        ([0, 0, 0, 0], 8, "\"this network\" (0.0.0.0/8)"),
        ([127, 0, 0, 0], 8, "loopback"),
        ([10, 0, 0, 0], 8, "private"),
        ([172, 16, 0, 0], 12, "private"),
        ([192, 168, 0, 0], 16, "private"),
        ([169, 254, 0, 0], 16, "link-local"),
        ([100, 64, 0, 0], 10, "carrier-grade NAT (100.64.0.0/10)"),
        ([192, 0, 0, 0], 24, "an IETF protocol assignment"),
        ([192, 0, 2, 0], 24, "documentation"),
        ([198, 51, 100, 0], 24, "documentation"),
        ([203, 0, 113, 0], 24, "documentation"),
        ([198, 18, 0, 0], 15, "benchmarking"),
        ([255, 255, 255, 255], 32, "broadcast"),
        ([224, 0, 0, 0], 4, "multicast"),
        ([240, 0, 0, 0], 4, "reserved"),
    ];
    table
        .iter()
        .find(|(net, len, _)| in_v4(ip, *net, *len))
        .map(|(_, _, why)| *why)
}

fn in_v6(ip: Ipv6Addr, net: [u16; 8], len: u8) -> bool {
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - len)
    };
    u128::from(ip) & mask == u128::from(Ipv6Addr::from(net)) & mask
}

fn special_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let bits = u128::from(ip);
    let embedded_low = Ipv4Addr::from((bits & 0xffff_ffff) as u32);
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    // ::ffff:a.b.c.d (mapped), 64:ff9b::a.b.c.d (NAT64): the IPv4 address.
    if in_v6(ip, [0, 0, 0, 0, 0, 0xffff, 0, 0], 96)
        || in_v6(ip, [0x64, 0xff9b, 0, 0, 0, 0, 0, 0], 96)
    {
        return special_v4(embedded_low);
    }
    if in_v6(ip, [0, 0, 0, 0, 0, 0, 0, 0], 96) {
        return Some("IPv4-compatible (deprecated)");
    }
    // 2002:a.b.c.d::/48 (6to4): the IPv4 address.
    if in_v6(ip, [0x2002, 0, 0, 0, 0, 0, 0, 0], 16) {
        let v4 = Ipv4Addr::from(((bits >> 80) & 0xffff_ffff) as u32);
        return special_v4(v4);
    }
    let table: &[([u16; 8], u8, &'static str)] = &[
        ([0x64, 0xff9b, 1, 0, 0, 0, 0, 0], 48, "NAT64 local use"),
        ([0x100, 0, 0, 0, 0, 0, 0, 0], 64, "discard-only"),
        ([0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32, "documentation"),
        ([0x3fff, 0, 0, 0, 0, 0, 0, 0], 20, "documentation"),
        (
            [0x2001, 0, 0, 0, 0, 0, 0, 0],
            23,
            "an IETF protocol assignment",
        ),
        ([0xfc00, 0, 0, 0, 0, 0, 0, 0], 7, "unique-local"),
        ([0xfe80, 0, 0, 0, 0, 0, 0, 0], 10, "link-local"),
        ([0xfec0, 0, 0, 0, 0, 0, 0, 0], 10, "site-local (deprecated)"),
        ([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, "multicast"),
    ];
    table
        .iter()
        .find(|(net, len, _)| in_v6(ip, *net, *len))
        .map(|(_, _, why)| *why)
}

/// `url` as `scheme://host[:port]/path`, without credentials, query or
/// fragment: safe for logs and errors.
pub fn redact(url: &str) -> String {
    match Url::parse(url) {
        Ok(u) => {
            let host = u.host_str().unwrap_or_default();
            let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
            let path = if u.cannot_be_a_base() { "" } else { u.path() };
            format!("{}://{host}{port}{path}", u.scheme())
        }
        Err(_) => "(an unparseable URL)".into(),
    }
}

/// `url` as `scheme://host[:port]`, and `/…` for any path: for a URL
/// whose path may be its credential (Slack's, Discord's and Teams'
/// incoming webhooks), which [`redact`] would show.
pub fn redact_origin(url: &str) -> String {
    match Url::parse(url) {
        Ok(u) if !u.cannot_be_a_base() => {
            let host = u.host_str().unwrap_or_default();
            let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
            let path = if u.path() == "/" { "/" } else { "/…" };
            format!("{}://{host}{port}{path}", u.scheme())
        }
        _ => "(an unparseable URL)".into(),
    }
}

/// `text` (an error's) with `url` in it as [`redact`] shows it: the HTTP
/// client's errors name a request's URL whole, query included.
pub fn scrub(text: &str, url: &str) -> String {
    let shown = redact(url);
    let mut text = text.replace(url, &shown);
    if let Ok(mut u) = Url::parse(url) {
        text = text.replace(u.as_str(), &shown);
        // As the client sends it: its credentials go in a header.
        let _ = u.set_username("");
        let _ = u.set_password(None);
        text = text.replace(u.as_str(), &shown);
    }
    text
}

/// A failed request's error with its causes (a refused connection, a
/// name that did not resolve), and without its URL.
pub fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests;
