use diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError};
use serde::Deserialize;

#[derive(Deserialize)]
struct UserCreated {
    user_id: uuid::Uuid,
}

#[idempotent_handler(key = "user_id")]
async fn create_user(conn: &mut AsyncPgConnection, msg: UserCreated) -> Result<(), HandlerError> {
    let _ = (conn, msg);
    Ok(())
}

fn assert_handler<H: idemq::Handler<Message = UserCreated>>(_: H) {}

pub(crate) fn main() {
    assert_handler(create_user);
    let user_id = uuid::Uuid::from_u128(0x67e5_5044_10b1_426f_9247_bb68_0e5f_e0c8);
    let key = idemq::Handler::key(
        &create_user,
        &UserCreated { user_id },
        &idemq::Metadata::new(&Default::default(), &[]),
    )
    .unwrap();
    assert_eq!(key.as_str(), "67e55044-10b1-426f-9247-bb680e5fe0c8");
}
