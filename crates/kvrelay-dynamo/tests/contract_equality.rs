//! Our `.proto` against Dynamo's running relay: the descriptors its reflection serves
//! (Dynamo 1.6.1 from PyPI, a separate process on loopback) must equal ours, message by
//! message, field by field, enum value by enum value, method by method. The serving-load
//! additions of 1.7 are ours only (1.6.1 predates them), and the test says exactly which.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod interop;

use std::collections::{BTreeMap, BTreeSet};

use prost::Message;
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorProto, FileDescriptorSet};
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

/// What 1.7 added to v1 and a 1.6.1 relay does not serve.
const SERVING_LOAD: &[&str] = &[
    "enum dynamo.kvrelay.v1.DataStatus",
    "message dynamo.kvrelay.v1.SubscribeServingLoadRequest",
    "message dynamo.kvrelay.v1.RequestLifecycleStats",
    "message dynamo.kvrelay.v1.TokenLoadStats",
    "message dynamo.kvrelay.v1.LoadView",
    "message dynamo.kvrelay.v1.PoolDeploymentStatus",
    "message dynamo.kvrelay.v1.PoolServingLoad",
    "message dynamo.kvrelay.v1.ModelDeploymentStatus",
    "message dynamo.kvrelay.v1.ModelServingLoad",
    "message dynamo.kvrelay.v1.ServingLoadUpdate",
    "rpc dynamo.kvrelay.v1.KvEventRelay.SubscribeServingLoad",
];

/// Every named item of a file as one line of text per item, keyed by its kind and full name.
/// Only what the wire and generated code depend on: names, numbers, types, labels,
/// `oneof` membership, proto3 `optional`, streaming. Comments, options, JSON names and the
/// file's own name are not compared.
fn items(file: &FileDescriptorProto) -> BTreeMap<String, String> {
    let package = file.package();
    let mut items = BTreeMap::new();
    for message in &file.message_type {
        message_items(
            &format!("{package}.{}", message.name()),
            message,
            &mut items,
        );
    }
    for enumeration in &file.enum_type {
        enum_item(
            &format!("{package}.{}", enumeration.name()),
            enumeration,
            &mut items,
        );
    }
    for service in &file.service {
        for method in &service.method {
            items.insert(
                format!("rpc {package}.{}.{}", service.name(), method.name()),
                format!(
                    "{} -> {} client_streaming={} server_streaming={}",
                    method.input_type(),
                    method.output_type(),
                    method.client_streaming(),
                    method.server_streaming()
                ),
            );
        }
    }
    items
}

fn message_items(name: &str, message: &DescriptorProto, items: &mut BTreeMap<String, String>) {
    let mut fields: Vec<_> = message.field.iter().collect();
    fields.sort_by_key(|field| field.number());
    let text = fields
        .iter()
        .map(|field| {
            format!(
                "{}={} {:?} {:?} {} oneof={:?} optional={}",
                field.name(),
                field.number(),
                field.label(),
                field.r#type(),
                field.type_name(),
                field
                    .oneof_index
                    .and_then(|at| message.oneof_decl.get(usize::try_from(at).ok()?))
                    .map(|oneof| oneof.name()),
                field.proto3_optional(),
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    items.insert(format!("message {name}"), text);
    for nested in &message.nested_type {
        message_items(&format!("{name}.{}", nested.name()), nested, items);
    }
    for enumeration in &message.enum_type {
        enum_item(
            &format!("{name}.{}", enumeration.name()),
            enumeration,
            items,
        );
    }
}

fn enum_item(name: &str, enumeration: &EnumDescriptorProto, items: &mut BTreeMap<String, String>) {
    let values = enumeration
        .value
        .iter()
        .map(|value| format!("{}={}", value.name(), value.number()))
        .collect::<Vec<_>>()
        .join(" ");
    items.insert(format!("enum {name}"), values);
}

fn ours() -> BTreeMap<String, String> {
    let set = FileDescriptorSet::decode(kvrelay_dynamo::proto::FILE_DESCRIPTOR_SET).unwrap();
    let file = set
        .file
        .iter()
        .find(|file| file.package() == "dynamo.kvrelay.v1")
        .expect("our descriptor set holds the contract");
    items(file)
}

async fn theirs(addr: &str) -> BTreeMap<String, String> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol(
            "dynamo.kvrelay.v1.KvEventRelay".to_owned(),
        )),
    };
    let mut answers = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .expect("Dynamo's relay serves reflection v1")
        .into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::FileDescriptorResponse(files)) = answer.message_response else {
        panic!("expected file descriptors, got {answer:?}")
    };
    let file = files
        .file_descriptor_proto
        .iter()
        .map(|bytes| FileDescriptorProto::decode(bytes.as_slice()).unwrap())
        .find(|file| file.package() == "dynamo.kvrelay.v1")
        .expect("the contract's file");
    items(&file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_schema_equals_the_one_dynamos_relay_serves() {
    let relay = interop::DynamoFleet::start().await;
    let theirs = theirs(&relay.addr).await;
    let mut ours = ours();
    let extra: BTreeSet<&str> = ours
        .keys()
        .filter(|name| !theirs.contains_key(*name))
        .map(String::as_str)
        .collect();
    assert_eq!(
        extra,
        SERVING_LOAD.iter().copied().collect::<BTreeSet<_>>(),
        "items we declare beyond Dynamo 1.6.1's: only the serving-load additions"
    );
    ours.retain(|name, _| !SERVING_LOAD.contains(&name.as_str()));
    let mismatched: Vec<_> = theirs
        .iter()
        .filter(|(name, text)| ours.get(*name) != Some(text))
        .map(|(name, text)| format!("{name}\n  theirs: {text}\n  ours:   {:?}", ours.get(name)))
        .collect();
    assert!(mismatched.is_empty(), "{}", mismatched.join("\n"));
    // The comparison saw the whole 1.6.1 contract: its five RPCs and the pool stream.
    let rpcs = theirs
        .keys()
        .filter(|name| name.starts_with("rpc "))
        .count();
    assert_eq!(rpcs, 5, "{:?}", theirs.keys());
    assert!(theirs.contains_key("message dynamo.kvrelay.v1.FilterUpdate"));
}
