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
    let request: RouteRequest =
        parse(br#"{"tokens":[1,2,3],"model":"m","lora":"l","namespace":"t","top_k":2}"#).unwrap();
    let (score, top_k) = request.validate(&limits()).unwrap();
    assert_eq!(score.tokens, [1, 2, 3]);
    assert_eq!(score.model, "m");
    assert_eq!(score.lora.as_deref(), Some("l"));
    assert_eq!(score.cache_namespace.as_deref(), Some("t"));
    assert_eq!(top_k, 2);
    let request: RouteRequest = parse(br#"{"tokens":[],"model":"m"}"#).unwrap();
    assert_eq!(request.validate(&limits()).unwrap().1, usize::MAX);
}

#[test]
fn errors_name_the_field() {
    let err = parse::<RouteRequest>(br#"{"tokens":[1,-2],"model":"m"}"#).unwrap_err();
    assert_eq!((err.status, err.field.as_deref()), (400, Some("tokens[1]")));
    let err = parse::<RouteRequest>(br#"{"tokens":[1]}"#).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("model"), "{err:?}");
    let err = parse::<RouteRequest>(br#"{"tokens":[1],"model":"m","temperature":1}"#).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("temperature"), "{err:?}");
    let err = parse::<RouteRequest>(br#"{"tokens":"abc","model":"m"}"#).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("tokens"), "{err:?}");
    let err = parse::<RouteRequest>(br#"{"tokens":[1],"model":"m"} {}"#).unwrap_err();
    assert!(err.message.contains("trailing"), "{err:?}");
    let body = err.body();
    assert_eq!(body["error"]["code"], "invalid_request");
}

#[test]
fn limits_are_enforced_with_the_limit_named() {
    let many: RouteRequest = parse(br#"{"tokens":[1,2,3,4,5,6,7,8,9],"model":"m"}"#).unwrap();
    let err = many.validate(&limits()).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("tokens"));
    assert!(err.message.contains("max_tokens"), "{err:?}");
    for (top_k, needle) in [("0", "at least 1"), ("5", "max_top_k")] {
        let request: RouteRequest =
            parse(format!(r#"{{"tokens":[1],"model":"m","top_k":{top_k}}}"#).as_bytes()).unwrap();
        let err = request.validate(&limits()).unwrap_err();
        assert_eq!(err.field.as_deref(), Some("top_k"));
        assert!(err.message.contains(needle), "{err:?}");
    }
    let blank: RouteRequest = parse(br#"{"tokens":[1],"model":"  "}"#).unwrap();
    assert_eq!(
        blank.validate(&limits()).unwrap_err().field.as_deref(),
        Some("model")
    );
}

#[test]
fn batch_errors_name_the_request_and_field() {
    let batch: BatchRequest =
        parse(br#"{"requests":[{"tokens":[1],"model":"m"},{"tokens":[1],"model":"m","top_k":9}]}"#)
            .unwrap();
    let err = batch.validate(&limits()).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("requests[1].top_k"));
    let err = parse::<BatchRequest>(br#"{"requests":[{"tokens":[1]}]}"#).unwrap_err();
    assert_eq!(err.field.as_deref(), Some("requests[0].model"), "{err:?}");
    let too_many: BatchRequest = parse(
        br#"{"requests":[{"tokens":[1],"model":"m"},{"tokens":[1],"model":"m"},{"tokens":[1],"model":"m"}]}"#,
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
