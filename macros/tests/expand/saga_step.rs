/// Idempotent handler `order_placed` (dedup key `order_id`); register it with the runtime. The original fn is [`order_placed::call`].
#[allow(non_camel_case_types)]
#[derive(
    ::core::fmt::Debug,
    ::core::clone::Clone,
    ::core::marker::Copy,
    ::core::default::Default
)]
struct order_placed;
impl order_placed {
    /// The fn `order_placed` as written, for unit tests; the runtime calls it through `idemq::Handler`, inside its transaction.
    async fn call(
        conn: &mut AsyncPgConnection,
        msg: OrderPlaced,
        saga: &mut Saga<Order>,
        ctx: &mut Context,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}
impl ::idemq::Handler for order_placed {
    type Message = OrderPlaced;
    fn name(&self) -> &'static str {
        "order_placed"
    }
    fn key_path(&self) -> &'static str {
        "order_id"
    }
    fn key(
        &self,
        __idemq_message: &<Self as ::idemq::Handler>::Message,
        __idemq_metadata: &::idemq::Metadata<'_>,
    ) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
        let _ = __idemq_metadata;
        let __idemq_keyed = __idemq_message;
        ::idemq::key::KeyField::to_key(&(*__idemq_keyed).order_id)
    }
    fn saga_key(
        &self,
        __idemq_message: &<Self as ::idemq::Handler>::Message,
        __idemq_metadata: &::idemq::Metadata<'_>,
    ) -> ::core::option::Option<
        ::core::result::Result<::idemq::Key, ::idemq::key::KeyError>,
    > {
        ::core::option::Option::Some(
            <Order as ::idemq::saga::Takes<
                OrderPlaced,
            >>::correlate(__idemq_message, __idemq_metadata),
        )
    }
    fn saga_key_path(&self) -> ::core::option::Option<&'static str> {
        ::core::option::Option::Some(
            <Order as ::idemq::saga::Takes<OrderPlaced>>::KEY_PATH,
        )
    }
    fn saga(&self) -> ::core::option::Option<::idemq::__private::SagaShape> {
        ::core::option::Option::Some(::idemq::__private::SagaShape {
            name: <Order as ::idemq::saga::SagaState>::NAME,
            takes: <Order as ::idemq::saga::SagaState>::TAKES,
            sends: <Order as ::idemq::saga::SagaState>::SENDS,
        })
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
        ::std::boxed::Box::pin(async move {
            let ::core::option::Option::Some(mut __idemq_saga) = ::idemq::saga::__begin::<
                Order,
            >(
                    &mut *__idemq_conn,
                    &mut *__idemq_ctx,
                    ::idemq::saga::IfMissing::Start,
                    ::idemq::saga::IfFinished::Ignore,
                    ::core::option::Option::Some(
                        ::idemq::__private::__idemq_saga_start::<Order>,
                    ),
                )
                .await? else {
                return ::core::result::Result::Ok(::idemq::HandlerOutput::none());
            };
            let result = {
                let __idemq_conn = <&mut AsyncPgConnection as ::idemq::__private::__IdemqConnection<
                    '_,
                >>::__idemq_connection(__idemq_conn);
                let __idemq_ctx = <&mut Context as ::idemq::__private::__IdemqContext<
                    '_,
                >>::__idemq_context(&mut *__idemq_ctx);
                order_placed::call(
                        __idemq_conn,
                        __idemq_message,
                        &mut __idemq_saga,
                        __idemq_ctx,
                    )
                    .await
            };
            match <Result<
                (),
                HandlerError,
            > as ::idemq::__private::__IdemqResult<_, _>>::__idemq_result(result) {
                ::core::result::Result::Ok(value) => {
                    ::idemq::saga::__end(
                            &mut *__idemq_conn,
                            &mut *__idemq_ctx,
                            __idemq_saga,
                        )
                        .await?;
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
