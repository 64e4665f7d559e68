//! API bodies: strict parsing, errors naming the field, limits, and score errors' statuses.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests fail loudly")]

use super::*;

fn limits() -> HttpSection {
    HttpSection {
        max_tokens: 8,
        max_batch: 2,
        max_top_k: 4,
        ..HttpSection::default()
    }
}

#[test]
fn a_valid_request_becomes_a_score_request() {
    let request: RouteRequest = parse(
        br#"{"tokens":[1,2,3],"model":"m","lora":"l","namespace":"t","top_k":2}"#,
        &HttpSection::default(),
    )
    .unwrap();
    let (score, top_k) = request.validate(&limits()).unwrap();
    assert_eq!(score.tokens, [1, 2, 3]);
    assert_eq!(score.model, "m");
    assert_eq!(score.lora.as_deref(), Some("l"));
    assert_eq!(score.cache_namespace.as_deref(), Some("t"));
    assert_eq!(top_k, 2);
    let request: RouteRequest =
        parse(br#"{"tokens":[],"model":"m"}"#, &HttpSection::default()).unwrap();
    assert_eq!(request.validate(&limits()).unwrap().1, usize::MAX);
}

#[test]
fn errors_name_the_field() {
    let err = parse::<RouteRequest>(br#"{"tokens":[1,-2],"model":"m"}"#, &HttpSection::default())
        .unwrap_err();
    assert_eq!((err.status, err.field.as_deref()), (400, Some("tokens[1]")));
    let err = parse::<RouteRequest>(br#"{"tokens":[1]}"#, &HttpSection::default()).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("model"), "{err:?}");
    let err = parse::<RouteRequest>(
        br#"{"tokens":[1],"model":"m","temperature":1}"#,
        &HttpSection::default(),
    )
    .unwrap_err();
    assert_eq!(err.field.as_deref(), Some("temperature"), "{err:?}");
    let err = parse::<RouteRequest>(br#"{"tokens":"abc","model":"m"}"#, &HttpSection::default())
        .unwrap_err();
    assert_eq!(err.field.as_deref(), Some("tokens"), "{err:?}");
    let err = parse::<RouteRequest>(br#"{"tokens":[1],"model":"m"} {}"#, &HttpSection::default())
        .unwrap_err();
    assert!(err.message.contains("trailing"), "{err:?}");
    let body = err.body();
    assert_eq!(body["error"]["code"], "invalid_request");
}

#[test]
fn limits_are_enforced_with_the_limit_named() {
    let many: RouteRequest = parse(
        br#"{"tokens":[1,2,3,4,5,6,7,8,9],"model":"m"}"#,
        &HttpSection::default(),
    )
    .unwrap();
    let err = many.validate(&limits()).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("tokens"));
    assert!(err.message.contains("max_tokens"), "{err:?}");
    for (top_k, needle) in [("0", "at least 1"), ("5", "max_top_k")] {
        let request: RouteRequest = parse(
            format!(r#"{{"tokens":[1],"model":"m","top_k":{top_k}}}"#).as_bytes(),
            &HttpSection::default(),
        )
        .unwrap();
        let err = request.validate(&limits()).unwrap_err();
        assert_eq!(err.field.as_deref(), Some("top_k"));
        assert!(err.message.contains(needle), "{err:?}");
    }
    let blank: RouteRequest =
        parse(br#"{"tokens":[1],"model":"  "}"#, &HttpSection::default()).unwrap();
    assert_eq!(
        blank.validate(&limits()).unwrap_err().field.as_deref(),
        Some("model")
    );
}

#[test]
fn batch_errors_name_the_request_and_field() {
    let batch: BatchRequest = parse(
        br#"{"requests":[{"tokens":[1],"model":"m"},{"tokens":[1],"model":"m","top_k":9}]}"#,
        &HttpSection::default(),
    )
    .unwrap();
    let err = batch.validate(&limits()).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("requests[1].top_k"));
    let err = parse::<BatchRequest>(br#"{"requests":[{"tokens":[1]}]}"#, &HttpSection::default())
        .unwrap_err();
    assert_eq!(err.field.as_deref(), Some("requests[0].model"), "{err:?}");
    let too_many: BatchRequest = parse(
        br#"{"requests":[{"tokens":[1],"model":"m"},{"tokens":[1],"model":"m"},{"tokens":[1],"model":"m"}]}"#,
        &HttpSection::default(),
    )
    .unwrap();
    let err = too_many.validate(&limits()).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("requests"));
    assert!(err.message.contains("max_batch"));
}

#[test]
fn score_errors_map_to_statuses() {
    let unknown = score_error(&ScoreError::UnknownModel { model: "x".into() });
    assert_eq!((unknown.status, unknown.code), (404, "unknown_model"));
    let ambiguous = score_error(&ScoreError::AmbiguousModel {
        model: "x".into(),
        bindings: vec!["a".into(), "b".into()],
    });
    assert_eq!(ambiguous.status, 409);
    let adapter = score_error(&ScoreError::UnknownAdapter {
        model: "x".into(),
        adapter: "y".into(),
    });
    assert_eq!(
        (adapter.status, adapter.field.as_deref()),
        (404, Some("lora"))
    );
}

/// A route request as JSON: every optional field absent, `null` or set, fields in the
/// given order, `gap` between every token.
fn route_json(request: &RouteRequest, nulls: bool, reversed: bool, gap: &str) -> String {
    let tokens = request
        .tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(&format!(",{gap}"));
    let mut fields = vec![
        format!("{gap}\"tokens\"{gap}:{gap}[{gap}{tokens}{gap}]"),
        format!(
            "\"model\":{}",
            serde_json::to_string(&request.model).unwrap()
        ),
    ];
    let optional = [
        (
            "lora",
            request
                .lora
                .as_ref()
                .map(|s| serde_json::to_string(s).unwrap()),
        ),
        (
            "namespace",
            request
                .namespace
                .as_ref()
                .map(|s| serde_json::to_string(s).unwrap()),
        ),
        ("top_k", request.top_k.map(|k| k.to_string())),
    ];
    for (name, value) in optional {
        match value {
            Some(value) => fields.push(format!("\"{name}\":{value}")),
            None if nulls => fields.push(format!("\"{name}\":null")),
            None => {}
        }
    }
    if reversed {
        fields.reverse();
    }
    format!("{gap}{{{}}}{gap}", fields.join(&format!("{gap},")))
}

fn serde_parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Option<T> {
    serde_json::from_slice(body).ok()
}

mod common_shape {
    use proptest::prelude::*;

    use super::*;

    fn text() -> impl Strategy<Value = String> {
        // Plain names, and names that need escapes or are not ASCII (serde_json writes
        // those escaped or raw; the fast parser declines escapes and takes raw UTF-8).
        prop_oneof!["[a-z0-9/._-]{0,12}", "[a-z\"\\\\\n\u{e9}\u{1F600}]{0,6}",]
    }

    fn request() -> impl Strategy<Value = RouteRequest> {
        (
            prop::collection::vec(
                prop_oneof![
                    any::<u32>(),
                    // Every length of token id, one to nine digits.
                    (any::<u32>(), 1u32..=9).prop_map(|(id, digits)| id % 10u32.pow(digits)),
                    Just(u32::MAX),
                ],
                0..40,
            ),
            text(),
            prop::option::of(text()),
            prop::option::of(text()),
            prop::option::of(prop_oneof![any::<usize>(), 0usize..10]),
        )
            .prop_map(|(tokens, model, lora, namespace, top_k)| RouteRequest {
                tokens,
                model,
                lora,
                namespace,
                top_k,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Whatever the fast parser accepts, serde_json parses to the same request; the
        /// shape clients send (no escapes) it accepts.
        #[test]
        fn the_fast_parser_agrees_with_serde(
            request in request(),
            nulls in any::<bool>(),
            reversed in any::<bool>(),
            gap in prop_oneof![Just(""), Just(" "), Just("\n\t ")],
        ) {
            let body = route_json(&request, nulls, reversed, gap);
            let fast = fast_path::route_request(body.as_bytes());
            let exact = serde_parse::<RouteRequest>(body.as_bytes());
            prop_assert_eq!(exact.as_ref(), Some(&request));
            let needs_escape = |s: &str| s.contains(['"', '\\', '\n']);
            let escaped = needs_escape(&request.model)
                || request.lora.as_deref().is_some_and(needs_escape)
                || request.namespace.as_deref().is_some_and(needs_escape);
            if escaped {
                prop_assert!(fast.is_none() || fast == exact);
            } else {
                prop_assert_eq!(fast, exact);
            }
        }

        /// A body damaged anywhere (a byte replaced, inserted or removed): the fast parser
        /// declines it or agrees with serde_json, never accepting what serde_json refuses.
        #[test]
        fn on_damaged_bodies_the_fast_parser_declines_or_agrees(
            request in request(),
            nulls in any::<bool>(),
            at in any::<prop::sample::Index>(),
            byte in prop_oneof![
                Just(b'0'), Just(b'9'), Just(b'-'), Just(b'.'), Just(b'e'), Just(b','),
                Just(b'"'), Just(b'\\'), Just(b'{'), Just(b'}'), Just(b'['), Just(b']'),
                Just(b':'), Just(b' '), Just(b'n'), Just(0xff), any::<u8>(),
            ],
            edit in 0u8..3,
        ) {
            let mut body = route_json(&request, nulls, false, "").into_bytes();
            let at = at.index(body.len());
            match edit {
                0 => body[at] = byte,
                1 => body.insert(at, byte),
                _ => {
                    body.remove(at);
                }
            }
            if let Some(fast) = fast_path::route_request(&body) {
                prop_assert_eq!(Some(fast), serde_parse::<RouteRequest>(&body));
            }
            let batch = [b"{\"requests\":[".as_slice(), &body, b"]}"].concat();
            if let Some(fast) = fast_path::batch_request(&batch, usize::MAX) {
                prop_assert_eq!(Some(fast), serde_parse::<BatchRequest>(&batch));
            }
        }

        /// Batches of common-shape requests take the fast path and equal serde_json's parse.
        #[test]
        fn batches_take_the_fast_path(
            requests in prop::collection::vec(request(), 0..5),
            gap in prop_oneof![Just(""), Just(" \n")],
        ) {
            let body = format!(
                "{{{gap}\"requests\"{gap}:{gap}[{}]{gap}}}",
                requests
                    .iter()
                    .map(|request| route_json(request, false, false, gap))
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let exact = serde_parse::<BatchRequest>(body.as_bytes());
            prop_assert_eq!(exact.as_ref().map(|b| &b.requests), Some(&requests));
            let fast = fast_path::batch_request(body.as_bytes(), usize::MAX);
            prop_assert!(fast.is_none() || fast == exact);
            let plain = |s: &str| !s.contains(['"', '\\', '\n']);
            if requests.iter().all(|r| plain(&r.model)
                && r.lora.as_deref().is_none_or(plain)
                && r.namespace.as_deref().is_none_or(plain))
            {
                prop_assert_eq!(fast, exact);
            }
        }
    }
}

#[test]
fn the_fast_parser_declines_what_serde_refuses_and_parse_names_the_field() {
    for (body, field) in [
        (r#"{"tokens":[1,01],"model":"m"}"#, "tokens[1]"),
        (r#"{"tokens":[1,4294967296],"model":"m"}"#, "tokens[1]"),
        (r#"{"tokens":[1,2.0],"model":"m"}"#, "tokens[1]"),
        (r#"{"tokens":[1,2e1],"model":"m"}"#, "tokens[1]"),
        (r#"{"tokens":[-0],"model":"m"}"#, "tokens[0]"),
        (r#"{"tokens":[1],"model":"m","model":"n"}"#, "model"),
        (r#"{"tokens":[1],"model":"m","top_k":-1}"#, "top_k"),
        (r#"{"tokens":[1],"model":null}"#, "model"),
        (r#"{"tokens":[1,],"model":"m"}"#, "tokens"),
    ] {
        assert!(
            fast_path::route_request(body.as_bytes()).is_none(),
            "fast path declines {body}"
        );
        let err = parse::<RouteRequest>(body.as_bytes(), &HttpSection::default()).unwrap_err();
        assert_eq!(err.field.as_deref(), Some(field), "{body}: {err:?}");
    }
    // Escapes are outside the fast subset but valid JSON: serde_json decides.
    let escaped = br#"{"tokens":[7],"model":"m\u0065"}"#;
    assert!(fast_path::route_request(escaped).is_none());
    assert_eq!(
        parse::<RouteRequest>(escaped, &HttpSection::default())
            .unwrap()
            .model,
        "me"
    );
}

mod direct_encoding {
    use std::sync::Arc;

    use kvrelay_consumer::{CandidateReadiness, CandidateShape, Coverage, ReplicaState};
    use proptest::prelude::*;

    use super::*;

    fn text() -> impl Strategy<Value = String> {
        // Every byte class serde_json treats apart: plain, quote, backslash, the short
        // escapes, other control characters, DEL and non-ASCII.
        prop_oneof![
            "[a-z0-9._-]{0,16}",
            prop::collection::vec(
                prop_oneof![
                    Just('"'),
                    Just('\\'),
                    Just('\u{8}'),
                    Just('\t'),
                    Just('\n'),
                    Just('\u{c}'),
                    Just('\r'),
                    Just('\0'),
                    Just('\u{1f}'),
                    Just('\u{7f}'),
                    Just('é'),
                    Just('\u{2028}'),
                    Just('😀'),
                    Just('a'),
                ],
                0..8,
            )
            .prop_map(|chars| chars.into_iter().collect()),
        ]
    }

    fn float() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            0.0f64..1.0,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
            Just(f64::MIN_POSITIVE / 2.0),
            Just(1e21),
            Just(1e-7),
        ]
    }

    fn leg() -> impl Strategy<Value = ScoredLeg> {
        (
            prop::sample::select(vec!["aggregated", "prefill", "decode", "decode_only"]),
            (text(), text()),
            any::<u32>(),
            (
                prop::sample::select(vec![
                    ReplicaState::Current,
                    ReplicaState::Assembling,
                    ReplicaState::Stale,
                    ReplicaState::Missing,
                ]),
                prop_oneof![
                    Just(Coverage::Complete),
                    Just(Coverage::Recovering),
                    any::<u8>()
                        .prop_map(|unroutable_percent| Coverage::Degraded { unroutable_percent }),
                    any::<u8>().prop_map(|omitted_percent| Coverage::Overfull { omitted_percent }),
                    (any::<u32>(), any::<u8>()).prop_map(|(code, unroutable_percent)| {
                        Coverage::Unrecognized {
                            code,
                            unroutable_percent,
                        }
                    }),
                ],
            ),
            (
                prop::option::of(any::<u32>()),
                prop::option::of(any::<u32>()),
                prop::option::of(any::<u32>()),
                prop::option::of(any::<u32>()),
            ),
            prop::option::of(float()),
        )
            .prop_map(
                |(
                    role,
                    (pool, endpoint),
                    block_size,
                    (replica, coverage),
                    (blocks, tokens, host_blocks, disk_blocks),
                    load,
                )| ScoredLeg {
                    role,
                    pool: Arc::from(pool),
                    endpoint: Arc::from(endpoint),
                    block_size,
                    replica,
                    coverage,
                    prefix_blocks: blocks,
                    prefix_tokens: tokens,
                    host_blocks,
                    disk_blocks,
                    load,
                },
            )
    }

    fn candidate() -> impl Strategy<Value = ScoredCandidate> {
        (
            text(),
            prop::sample::select(vec![
                CandidateShape::Aggregated,
                CandidateShape::Disaggregated,
                CandidateShape::DecodeOnly,
            ]),
            prop::collection::vec(leg(), 0..3),
            (prop::option::of(float()), prop::option::of(float())),
            (float(), float()),
            prop::sample::select(vec![CandidateReadiness::Ready, CandidateReadiness::Unknown]),
        )
            .prop_map(
                |(dc, shape, legs, (prefix, load), (dc_cost, score), readiness)| ScoredCandidate {
                    dc: Arc::from(dc),
                    shape,
                    legs,
                    prefix_fraction: prefix,
                    load_fraction: load,
                    dc_cost,
                    readiness,
                    score,
                },
            )
    }

    fn ranking() -> impl Strategy<Value = Ranking> {
        (
            text(),
            prop::option::of(text()),
            prop::collection::vec(candidate(), 0..5),
            any::<usize>(),
        )
            .prop_map(|(model, lora, candidates, n_not_ready)| Ranking {
                model,
                lora,
                candidates,
                n_not_ready,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The direct writer emits serde_json's encoding of `RouteResponse`, byte for byte.
        #[test]
        fn the_route_answer_is_serde_jsons_byte_for_byte(ranking in ranking()) {
            let mut direct = Vec::new();
            write_ranking(&mut direct, &ranking);
            let reference = serde_json::to_vec(&RouteResponse::from(&ranking)).unwrap();
            prop_assert_eq!(
                String::from_utf8_lossy(&direct),
                String::from_utf8_lossy(&reference)
            );
        }

        /// So does the batch writer, with rankings and error bodies mixed.
        #[test]
        fn the_batch_answer_is_serde_jsons_byte_for_byte(
            answers in prop::collection::vec(
                prop_oneof![
                    ranking().prop_map(Ok),
                    text().prop_map(|message| Err(ApiError::invalid("model", message).body())),
                ],
                0..4,
            ),
        ) {
            let mut direct = Vec::new();
            write_batch(&mut direct, &answers).unwrap();
            let reference = serde_json::to_vec(&BatchResponse {
                answers: answers
                    .iter()
                    .map(|answer| match answer {
                        Ok(ranking) => BatchAnswer::Ranking(RouteResponse::from(ranking)),
                        Err(body) => BatchAnswer::Error(body),
                    })
                    .collect(),
            })
            .unwrap();
            prop_assert_eq!(
                String::from_utf8_lossy(&direct),
                String::from_utf8_lossy(&reference)
            );
        }
    }
}

/// A 4 MiB body of tiny requests: the fast parser stops after `max_batch + 1` of them
/// (validation refuses the batch) and an empty token array reserves nothing, so a body
/// cannot make the router allocate per request (16 KiB each used to be reserved).
#[test]
fn a_batch_body_of_tiny_requests_parses_at_most_max_batch_plus_one() {
    let one = r#"{"tokens":[],"model":"m"}"#;
    let n = (4 << 20) / (one.len() + 1);
    let body = format!(r#"{{"requests":[{}]}}"#, vec![one; n].join(","));
    let parsed = fast_path::batch_request(body.as_bytes(), 256).unwrap();
    assert_eq!(parsed.requests.len(), 257);
    assert!(parsed.requests.iter().all(|r| r.tokens.capacity() == 0));
    let limits = HttpSection {
        max_batch: 256,
        ..HttpSection::default()
    };
    let error = parse::<BatchRequest>(body.as_bytes(), &limits)
        .unwrap()
        .validate(&limits)
        .unwrap_err();
    assert!(
        error.message.contains("max_batch (256)"),
        "{}",
        error.message
    );
}

/// Token reservations are bounded by each request's own array: over a batch they add up
/// to at most one token per two bytes of body.
#[test]
fn token_reservations_add_up_to_at_most_half_the_body() {
    let body = format!(
        r#"{{"requests":[{}]}}"#,
        vec![r#"{"tokens":[7],"model":"m"}"#; 1000].join(",")
    );
    let parsed = fast_path::batch_request(body.as_bytes(), usize::MAX).unwrap();
    let reserved: usize = parsed.requests.iter().map(|r| r.tokens.capacity()).sum();
    assert!(
        reserved <= body.len() / 2,
        "{reserved} tokens reserved for {} bytes",
        body.len()
    );
    assert!(parsed.requests.iter().all(|r| r.tokens == [7]));
}
