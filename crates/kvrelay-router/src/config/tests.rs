//! Router configuration: TOML parsing, defaults, and every refusal naming its cause.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests fail loudly")]

use std::time::Duration;

use kvrelay_consumer::BackoffConfigError;

use super::*;

const FULL: &str = r#"
listen = "127.0.0.1:9000"

[[relays]]
address = "127.0.0.1:7400"
dc = "us-east"
cost = 2.5

[[relays]]
address = "127.0.0.1:7401"
dc = "eu-west"
cost = 40
token_env = "EU_TOKEN"

[http]
max_body_bytes = 1024
max_concurrent_requests = 8

[consumer]
staleness_bound_ms = 12000
max_replica_bytes_per_relay = 268435456
snapshot_assembly_timeout_ms = 30000

[weights]
dc_cost = 0.02
"#;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn a_full_file_sets_every_section_and_leaves_the_rest_at_defaults() {
    let config = RouterConfig::from_toml(FULL).unwrap();
    assert_eq!(config.listen, "127.0.0.1:9000".parse().unwrap());
    assert_eq!(config.http.max_body_bytes, 1024);
    assert_eq!(config.http.max_concurrent_requests, 8);
    assert_eq!(config.http.max_batch, HttpSection::DEFAULT_MAX_BATCH);
    let consumer = config
        .consumer_config(|name| (name == "EU_TOKEN").then(|| "s3cret".to_owned()))
        .unwrap();
    assert_eq!(consumer.relays.len(), 2);
    assert_eq!(consumer.relays[0].dc, "us-east");
    assert!((consumer.relays[0].cost - 2.5).abs() < f64::EPSILON);
    assert!(consumer.relays[0].token.is_none());
    assert!(consumer.relays[1].token.is_some());
    assert_eq!(consumer.limits.staleness_bound, Duration::from_secs(12));
    // Every consumer bound has a key; these two were missing.
    assert_eq!(consumer.limits.max_replica_bytes_per_relay, 256 << 20);
    assert_eq!(
        consumer.limits.snapshot_assembly_timeout,
        Duration::from_secs(30)
    );
    assert_eq!(
        consumer.limits.connect_timeout,
        Limits::default().connect_timeout
    );
    assert!((consumer.weights.dc_cost - 0.02).abs() < f64::EPSILON);
    assert_eq!(consumer.subscriber_id, "kvrelay-router");
}

/// The shipped example is a configuration the router accepts, and its consumer values
/// are the defaults it documents (an example that no test loads rots with every new key).
#[test]
fn the_shipped_example_loads_with_the_documented_defaults() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/router.toml");
    let text = std::fs::read_to_string(path).unwrap();
    let config = RouterConfig::from_toml(&text).unwrap();
    let consumer = config.consumer_config(no_env).unwrap();
    assert_eq!(consumer.relays.len(), 1);
    assert_eq!(consumer.limits, Limits::default());
}

#[test]
fn every_weight_has_a_key_and_an_unset_one_keeps_the_consumers_default() {
    let config = RouterConfig::from_toml(
        "[[relays]]\naddress = \"127.0.0.1:1\"\ndc = \"x\"\n\n[weights]\nprefix = 2.0\n\
         decode_leg = 0.5\nload = 0.25\nunknown_load = 0.75\nhost_tier = 0.8\ndisk_tier = 0.4\n",
    )
    .unwrap();
    let weights = config.consumer_config(no_env).unwrap().weights;
    assert_eq!(
        weights,
        ScoreWeights {
            prefix: 2.0,
            decode_leg: 0.5,
            load: 0.25,
            unknown_load: 0.75,
            dc_cost: ScoreWeights::DEFAULT_DC_COST,
            host_tier: 0.8,
            disk_tier: 0.4,
        }
    );
    let err = RouterConfig::from_toml("[weights]\nhost = 0.5\n").unwrap_err();
    assert!(
        matches!(&err, RouterConfigError::Syntax { message } if message.contains("host")),
        "{err}"
    );
    // The consumer checks the values.
    let config = RouterConfig::from_toml(
        "[[relays]]\naddress = \"127.0.0.1:1\"\ndc = \"x\"\n\n[weights]\nhost_tier = 1.5\n",
    )
    .unwrap();
    assert!(config.consumer_config(no_env).is_err());
}

#[test]
fn defaults_listen_on_loopback() {
    let config = RouterConfig::from_toml("").unwrap();
    assert_eq!(config.listen, DEFAULT_LISTEN);
    assert!(config.listen.ip().is_loopback());
}

#[test]
fn an_unknown_key_is_refused_by_name() {
    let err = RouterConfig::from_toml("[http]\nmax_body = 3\n").unwrap_err();
    assert!(
        matches!(&err, RouterConfigError::Syntax { message } if message.contains("max_body")),
        "{err}"
    );
    let err = RouterConfig::from_toml("[[relays]]\naddress = \"a:1\"\ndc = \"x\"\ntoken = \"t\"\n")
        .unwrap_err();
    assert!(
        matches!(&err, RouterConfigError::Syntax { message } if message.contains("token")),
        "{err}"
    );
}

#[test]
fn a_file_that_cannot_be_read_or_parsed_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("absent.toml");
    let err = RouterConfig::from_file(&missing).unwrap_err();
    assert!(matches!(err, RouterConfigError::Read { .. }));
    assert!(err.to_string().contains("absent.toml"), "{err}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "listen = 7\n").unwrap();
    let err = RouterConfig::from_file(&bad).unwrap_err();
    assert!(matches!(err, RouterConfigError::Parse { .. }));
    assert!(err.to_string().contains("bad.toml"), "{err}");
}

#[test]
fn no_relays_is_refused() {
    let err = RouterConfig::default().consumer_config(no_env).unwrap_err();
    assert!(
        matches!(err, RouterConfigError::Consumer(ConfigError::NoRelays)),
        "{err}"
    );
}

#[test]
fn tls_settings_must_be_consistent() {
    let mut config = RouterConfig::default();
    let mut relay = RelaySection::new("127.0.0.1:7400", "a", 0.0);
    relay.tls_cert = Some("cert.pem".into());
    config.relays.push(relay.clone());
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(matches!(err, RouterConfigError::RelayTls { .. }), "{err}");

    relay.tls_ca = Some("ca.pem".into());
    config.relays[0] = relay;
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(err.to_string().contains("tls_cert and tls_key"), "{err}");
}

#[test]
fn a_missing_pem_or_token_is_reported_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = RouterConfig::default();
    let mut relay = RelaySection::new("127.0.0.1:7400", "a", 0.0);
    relay.tls_ca = Some(dir.path().join("no-ca.pem"));
    config.relays.push(relay);
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(err.to_string().contains("no-ca.pem"), "{err}");

    let mut relay = RelaySection::new("127.0.0.1:7400", "a", 0.0);
    relay.token_env = Some("ROUTER_TEST_TOKEN".to_owned());
    config.relays[0] = relay.clone();
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(
        matches!(err, RouterConfigError::TokenEnvMissing { ref name, .. } if name == "ROUTER_TEST_TOKEN"),
        "{err}"
    );

    relay.token_env = None;
    relay.token_file = Some(dir.path().join("no-token"));
    config.relays[0] = relay;
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(matches!(err, RouterConfigError::Token { .. }), "{err}");
}

#[test]
fn zero_http_bounds_are_refused_by_name() {
    let mut config = RouterConfig::default();
    config
        .relays
        .push(RelaySection::new("127.0.0.1:7400", "a", 0.0));
    config.http.max_batch = 0;
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(err.to_string().contains("max_batch"), "{err}");
}

#[test]
fn relay_arguments_parse_like_kvrelay_route() {
    let relay = RouterConfig::parse_relay("127.0.0.1:7400=us-east:12.5").unwrap();
    assert_eq!(relay.address, "127.0.0.1:7400");
    assert_eq!(relay.dc, "us-east");
    assert!((relay.cost - 12.5).abs() < f64::EPSILON);
    assert!(RouterConfig::parse_relay("127.0.0.1:7400=us-east:-1").is_err());
}

#[test]
fn a_relay_can_be_followed_over_dynamos_contract() {
    let relay = RouterConfig::parse_relay("dynamo-grpc://127.0.0.1:5561=us-west:3").unwrap();
    assert_eq!(relay.address, "127.0.0.1:5561");
    assert_eq!(relay.protocol.as_deref(), Some("dynamo-grpc"));
    assert_eq!(
        RouterConfig::parse_relay("127.0.0.1:7400=a")
            .unwrap()
            .protocol,
        None
    );
    assert!(RouterConfig::parse_relay("grpc://127.0.0.1:5561=a").is_err());

    let text = r#"
        [[relays]]
        address = "127.0.0.1:5561"
        dc = "us-west"
        protocol = "dynamo-grpc"

        [[relays]]
        address = "127.0.0.1:7400"
        dc = "us-east"
    "#;
    let consumer = RouterConfig::from_toml(text)
        .unwrap()
        .consumer_config(no_env)
        .unwrap();
    let protocols: Vec<_> = consumer.relays.iter().map(|relay| relay.protocol).collect();
    assert_eq!(
        protocols,
        [RelayProtocol::DynamoGrpc, RelayProtocol::Kvrelay]
    );

    let mut config = RouterConfig::from_toml(text).unwrap();
    config.relays[1].protocol = Some("carrier-pigeon".to_owned());
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(
        matches!(&err, RouterConfigError::RelayProtocol { dc, .. } if dc == "us-east"),
        "{err}"
    );
}

#[test]
fn the_backoff_must_be_positive_and_ordered() {
    let mut config = RouterConfig::default();
    config
        .relays
        .push(RelaySection::new("127.0.0.1:7400", "a", 0.0));
    config.consumer.backoff_initial_ms = 20;
    config.consumer.backoff_max_ms = 200;
    let consumer = config.consumer_config(no_env).unwrap();
    assert_eq!(consumer.backoff.initial, Duration::from_millis(20));
    assert_eq!(consumer.backoff.max, Duration::from_millis(200));
    config.consumer.backoff_max_ms = 10;
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(
        matches!(
            err,
            RouterConfigError::Consumer(ConfigError::Backoff(
                BackoffConfigError::MaxBelowInitial { .. }
            ))
        ),
        "{err}"
    );
    config.consumer.backoff_initial_ms = 0;
    let err = config.consumer_config(no_env).unwrap_err();
    assert!(
        matches!(
            err,
            RouterConfigError::Consumer(ConfigError::Backoff(BackoffConfigError::ZeroInitial))
        ),
        "{err}"
    );
}

#[test]
fn the_api_token_comes_from_a_file_or_the_environment_and_follows_the_token_rules() {
    let config = RouterConfig::from_toml("[auth]\ntoken_env = \"ROUTER_TOKEN\"\n").unwrap();
    let token = config
        .api_token(|name| (name == "ROUTER_TOKEN").then(|| " s3cret\n".to_owned()))
        .unwrap()
        .unwrap();
    assert_eq!(token.secret(), "s3cret");
    let err = config.api_token(no_env).unwrap_err();
    assert!(
        matches!(err, RouterConfigError::ApiTokenEnvMissing { .. }),
        "{err}"
    );
    let err = config
        .api_token(|_| Some("bad\u{7}token".to_owned()))
        .unwrap_err();
    assert!(err.to_string().contains("[auth]"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("token");
    std::fs::write(&path, "from-file\n").unwrap();
    let mut config = RouterConfig::default();
    config.auth.token_file = Some(path);
    assert_eq!(
        config.api_token(no_env).unwrap().unwrap().secret(),
        "from-file"
    );
    assert_eq!(RouterConfig::default().api_token(no_env).unwrap(), None);
}

#[test]
fn the_router_keeps_every_consumer_bound_and_its_default() {
    // Defaults are the consumer's own, not copies that could drift.
    assert_eq!(ConsumerSection::default().limits(), Limits::default());
    let config = RouterConfig::from_toml(
        "[consumer]\n\
         max_frame_len = 1048577\n\
         max_pools_per_relay = 17\n\
         max_replica_bytes_per_relay = 123456789\n\
         max_pool_streams_per_relay = 19\n\
         max_query_table_bytes = 987654321\n\
         connect_timeout_ms = 1111\n\
         staleness_bound_ms = 2222\n\
         catalog_staleness_bound_ms = 3333\n\
         snapshot_assembly_timeout_ms = 4444\n\
         resume_hold_ms = 5555\n\
         relay_silence_windows = 7\n\
         min_relay_silence_ms = 6666\n\
         failover_hold_ms = 8888\n\
         rejoin_interval_ms = 99\n\
         rejoin_window_ms = 9999\n\
         standby_probe_interval_ms = 7777\n",
    )
    .unwrap();
    assert_eq!(
        config.consumer.limits(),
        Limits {
            max_frame_len: 1_048_577,
            max_pools_per_relay: 17,
            max_replica_bytes_per_relay: 123_456_789,
            max_pool_streams_per_relay: 19,
            max_query_table_bytes: 987_654_321,
            connect_timeout: Duration::from_millis(1111),
            staleness_bound: Duration::from_millis(2222),
            catalog_staleness_bound: Duration::from_millis(3333),
            snapshot_assembly_timeout: Duration::from_millis(4444),
            resume_hold: Duration::from_millis(5555),
            relay_silence_windows: 7,
            min_relay_silence: Duration::from_millis(6666),
            failover_hold: Duration::from_millis(8888),
            rejoin_interval: Duration::from_millis(99),
            rejoin_window: Duration::from_millis(9999),
            standby_probe_interval: Duration::from_millis(7777),
        }
    );
}

/// A relay pair of one DC: `standby` in the file, `ADDR+STANDBY=DC` on the command line;
/// a repeated address is refused.
#[test]
fn a_dc_can_be_followed_through_a_relay_pair() {
    let text = r#"
        [[relays]]
        address = "10.0.0.1:7400"
        standby = ["10.0.0.2:7400"]
        dc = "us-east"
    "#;
    let consumer = RouterConfig::from_toml(text)
        .unwrap()
        .consumer_config(no_env)
        .unwrap();
    assert_eq!(consumer.relays.len(), 1);
    assert_eq!(
        consumer.relays[0].addresses().collect::<Vec<_>>(),
        ["10.0.0.1:7400", "10.0.0.2:7400"]
    );
    let parsed = RouterConfig::parse_relay("10.0.0.1:7400+10.0.0.2:7400=us-east").unwrap();
    assert_eq!(parsed.standby, ["10.0.0.2:7400"]);
    let repeated = r#"
        [[relays]]
        address = "10.0.0.1:7400"
        standby = ["10.0.0.1:7400"]
        dc = "us-east"
    "#;
    assert!(
        RouterConfig::from_toml(repeated)
            .unwrap()
            .consumer_config(no_env)
            .is_err()
    );
}

/// `standby_mode` picks how a pair's standby is kept: on demand by default, `hot` when
/// asked; any other word is refused, naming the choices.
#[test]
fn a_pairs_standby_mode_is_on_demand_unless_hot_is_asked() {
    let pair = r#"
        [[relays]]
        address = "10.0.0.1:7400"
        standby = ["10.0.0.2:7400"]
        dc = "us-east"
    "#;
    let mode = |consumer: &str| {
        RouterConfig::from_toml(&format!("[consumer]\n{consumer}\n{pair}"))
            .map(|config| config.consumer_config(no_env).unwrap().standby)
    };
    assert_eq!(mode("").unwrap(), StandbyMode::OnDemand);
    assert_eq!(
        mode("standby_mode = \"on-demand\"").unwrap(),
        StandbyMode::OnDemand
    );
    assert_eq!(mode("standby_mode = \"hot\"").unwrap(), StandbyMode::Hot);
    let refused = mode("standby_mode = \"warm\"").unwrap_err().to_string();
    assert!(
        refused.contains("on-demand") && refused.contains("hot"),
        "{refused}"
    );
}

/// The router's descriptor bound is the consumer's connections plus its HTTP listener and
/// connections plus the reserve; it grows with every bound that opens sockets.
#[test]
fn max_open_descriptors_adds_the_http_side_to_the_consumers_connections() {
    let toml = r#"
        [http]
        max_connections = 100
        [consumer]
        max_pool_streams_per_relay = 20
        [[relays]]
        address = "10.0.0.1:7400"
        dc = "us-east"
        [[relays]]
        address = "10.0.0.3:7400"
        standby = ["10.0.0.4:7400"]
        dc = "eu-west"
    "#;
    let config = RouterConfig::from_toml(toml).unwrap();
    let consumer = config.consumer_config(no_env).unwrap();
    assert_eq!(consumer.max_open_connections(), 2 * (3 + 20) + 1);
    assert_eq!(
        config.max_open_descriptors(&consumer),
        consumer.max_open_connections() + 1 + 100 + RouterConfig::DESCRIPTOR_RESERVE
    );
}
