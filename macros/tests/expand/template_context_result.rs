/// Idempotent handler `place` (dedup key `{tenant}:{@header:x-order}`); register it with the runtime. The original fn is [`place::call`].
#[allow(non_camel_case_types)]
#[derive(
    ::core::fmt::Debug,
    ::core::clone::Clone,
    ::core::marker::Copy,
    ::core::default::Default
)]
struct place;
impl place {
    /// The fn `place` as written, for unit tests; the runtime calls it through `idemq::Handler`, inside its transaction.
    async fn call(
        conn: &mut AsyncPgConnection,
        ctx: &mut Context,
        msg: &OrderPlaced,
    ) -> Result<Receipt, HandlerError> {
        Ok(Receipt)
    }
}
impl ::idemq::Handler for place {
    type Message = OrderPlaced;
    fn name(&self) -> &'static str {
        "place"
    }
    fn key_path(&self) -> &'static str {
        "{tenant}:{@header:x-order}"
    }
    fn key(
        &self,
        __idemq_message: &<Self as ::idemq::Handler>::Message,
        __idemq_metadata: &::idemq::Metadata<'_>,
    ) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
        let _ = __idemq_metadata;
        let __idemq_keyed = __idemq_message;
        ::idemq::Key::from_template(
            &[
                ::idemq::key::TemplatePart::Value(
                    ::idemq::key::KeyField::to_key(&(*__idemq_keyed).tenant),
                ),
                ::idemq::key::TemplatePart::Literal(":"),
                ::idemq::key::TemplatePart::Value(__idemq_metadata.header_key("x-order")),
            ],
        )
    }
    fn lane_path(&self) -> ::core::option::Option<&'static str> {
        ::core::option::Option::Some("tenant")
    }
    fn lane(
        &self,
        __idemq_message: &<Self as ::idemq::Handler>::Message,
    ) -> ::core::option::Option<
        ::core::result::Result<::idemq::Key, ::idemq::key::KeyError>,
    > {
        let __idemq_keyed = __idemq_message;
        ::core::option::Option::Some(
            ::idemq::key::KeyField::to_key(&(*__idemq_keyed).tenant),
        )
    }
    fn reply_type(&self) -> ::core::option::Option<&'static str> {
        ::core::option::Option::Some(::core::any::type_name::<Receipt>())
    }
    #[allow(clippy::needless_borrow)]
    fn wire(&self) -> ::idemq::__private::Wire<<Self as ::idemq::Handler>::Message> {
        #[allow(unused_imports)]
        use ::idemq::__private::{
            __IdemqNamedProbe as _, __IdemqNoSchemaProbe as _, __IdemqSchemaProbe as _,
            __IdemqUnnamedProbe as _, __IdemqUnversionedProbe as _,
            __IdemqVersionedProbe as _,
        };
        let probe = ::idemq::__private::__IdemqProbe::<
            <Self as ::idemq::Handler>::Message,
        >::new();
        ::idemq::__private::Wire::of(
            (&probe).__idemq_type_name(),
            (&probe).__idemq_versions(),
            (&probe).__idemq_schema(),
        )
    }
    fn handle<'__idemq_a>(
        &'__idemq_a self,
        __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
        __idemq_ctx: &'__idemq_a mut ::idemq::Context,
        __idemq_message: <Self as ::idemq::Handler>::Message,
    ) -> ::idemq::BoxFuture<
        '__idemq_a,
        ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>,
    > {
        let __idemq_conn = <&mut AsyncPgConnection as ::idemq::__private::__IdemqConnection<
            '_,
        >>::__idemq_connection(__idemq_conn);
        let __idemq_ctx = <&mut Context as ::idemq::__private::__IdemqContext<
            '_,
        >>::__idemq_context(&mut *__idemq_ctx);
        ::std::boxed::Box::pin(async move {
            let result = place::call(__idemq_conn, __idemq_ctx, &__idemq_message).await;
            match <Result<
                Receipt,
                HandlerError,
            > as ::idemq::__private::__IdemqResult<_, _>>::__idemq_result(result) {
                ::core::result::Result::Ok(value) => {
                    ::idemq::__private::__IdemqOutput::__idemq_output(&value)
                }
                ::core::result::Result::Err(error) => {
                    ::core::result::Result::Err(
                        ::idemq::__private::__IdemqError::__idemq_error(error),
                    )
                }
            }
        })
    }
}
