"""The Faust (aiokafka) side of the Kafka security settings that bus.config gives librdkafka."""

from __future__ import annotations

import ssl

import faust

from bus.config import KafkaSecurity


def faust_credentials(security: KafkaSecurity) -> faust.types.auth.CredentialsT | None:
    if security.protocol == "plaintext":
        return None
    context: ssl.SSLContext | None = None
    if security.protocol.endswith("ssl"):
        context = ssl.create_default_context(cafile=security.ssl_ca)
        if security.ssl_certificate:
            context.load_cert_chain(security.ssl_certificate, security.ssl_key)
    if security.protocol.startswith("sasl"):
        return faust.SASLCredentials(
            username=security.sasl_username,
            password=security.sasl_password,
            mechanism=security.sasl_mechanism,
            ssl_context=context,
        )
    return faust.SSLCredentials(context)
