//! Self-tests of the integration-test support library.

use std::time::Duration;

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemq_tests::{
    amqp_url, database_admin_url, eventually, header_i64, header_str, unique, with_timeout, Broker, TestDb,
    TestVhost,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

async fn database_exists(name: &str) -> bool {
    let mut admin =
        AsyncPgConnection::establish(&database_admin_url()).await.expect("connect to admin database");
    let names: Vec<String> =
        diesel::dsl::sql::<Text>(&format!("SELECT datname FROM pg_database WHERE datname = '{name}'"))
            .load(&mut admin)
            .await
            .expect("query pg_database");
    !names.is_empty()
}

#[tokio::test(flavor = "multi_thread")]
async fn test_db_is_created_and_dropped() {
    let db = TestDb::create().await;
    let name = db.name().to_owned();
    assert!(name.starts_with("idemq_t_"), "{name}");
    assert!(db.url().ends_with(&name), "{}", db.url());

    let mut conn = db.connect().await;
    let current: Vec<String> = diesel::dsl::sql::<Text>("SELECT current_database()")
        .load(&mut conn)
        .await
        .expect("query current_database()");
    assert_eq!(current, [name.as_str()]);
    assert!(database_exists(&name).await);

    // The open connection must not prevent the drop (WITH (FORCE)).
    drop(db);
    assert!(!database_exists(&name).await, "{name} still exists");
    drop(conn);
}

#[tokio::test(flavor = "multi_thread")]
async fn broker_publish_get_and_count_round_trip() {
    with_timeout("broker round trip", Duration::from_secs(30), async {
        let broker = Broker::connect(&amqp_url()).await;
        let queue = unique("selftest_q");
        broker.declare_queue(&queue).await;
        assert_eq!(broker.message_count(&queue).await, 0);
        assert!(broker.get(&queue).await.is_none());

        broker.publish_json(&queue, &serde_json::json!({"n": 1})).await;
        let mut headers = FieldTable::default();
        headers.insert("s".into(), AMQPValue::LongString("text".into()));
        headers.insert("i".into(), AMQPValue::ShortInt(-7));
        broker.publish_bytes(&queue, b"raw", BasicProperties::default().with_headers(headers)).await;
        broker.publish_json(&queue, &serde_json::json!({"n": 3})).await;
        assert_eq!(broker.message_count(&queue).await, 3);

        let first = broker.get(&queue).await.expect("first message");
        let value: serde_json::Value = serde_json::from_slice(&first.delivery.data).unwrap();
        assert_eq!(value, serde_json::json!({"n": 1}));
        assert_eq!(*first.delivery.properties.delivery_mode(), Some(2));
        assert_eq!(broker.message_count(&queue).await, 2);

        let rest = broker.drain(&queue).await;
        assert_eq!(rest.len(), 2);
        let props = &rest[0].delivery.properties;
        assert_eq!(rest[0].delivery.data, b"raw");
        assert_eq!(header_str(props, "s").as_deref(), Some("text"));
        assert_eq!(header_i64(props, "i"), Some(-7));
        assert_eq!(header_i64(props, "missing"), None);
        assert_eq!(broker.message_count(&queue).await, 0);

        broker.delete_queue(&queue).await;
        // Deleting again (missing queue) is fine.
        broker.delete_queue(&queue).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn vhost_is_usable_and_connections_can_be_killed() {
    with_timeout("vhost self-test", Duration::from_secs(60), async {
        let vhost = TestVhost::create().await;
        assert!(vhost.amqp_url().ends_with(&format!("/{}", vhost.name())));
        let broker = Broker::connect(&vhost.amqp_url()).await;
        broker.declare_queue("q").await;
        broker.publish_json("q", &serde_json::json!(1)).await;
        assert_eq!(broker.message_count("q").await, 1);

        vhost.close_all_connections().await;
        eventually("connection closed by broker", Duration::from_secs(10), || async {
            !broker.connection().status().connected()
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
#[should_panic(expected = "unroutable")]
async fn publishing_to_a_missing_queue_panics() {
    let broker = Broker::connect(&amqp_url()).await;
    broker.publish_json(&unique("selftest_missing"), &serde_json::json!(null)).await;
}
