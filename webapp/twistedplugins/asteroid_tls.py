"""Twisted's `asteroid-tls:` server endpoint: TLS on a listening socket the launcher made (daphne's `--fd` serves
plain HTTP only). `asteroid-tls:fileno=N:cert=PEM:key=PEM` serves on inherited descriptor N, each connection
wrapped in TLS as Twisted's own `ssl:` endpoint does, so daphne and Django see `https` and `wss`
(webapp/tlsdaphne.py uses it)."""

from __future__ import annotations

import socket

from twisted.internet import ssl
from twisted.internet.endpoints import AdoptedStreamServerEndpoint
from twisted.internet.interfaces import IStreamServerEndpoint, IStreamServerEndpointStringParser
from twisted.plugin import IPlugin
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface import implementer


@implementer(IStreamServerEndpoint)
class _Endpoint:
    def __init__(self, reactor, fileno: int, options):
        sock = socket.socket(fileno=fileno)  # only to learn its family; the endpoint adopts the descriptor itself
        family = sock.family
        sock.detach()
        self.adopted = AdoptedStreamServerEndpoint(reactor, fileno, family)
        self.options = options

    def listen(self, factory):
        return self.adopted.listen(TLSMemoryBIOFactory(self.options, False, factory))  # as Twisted's listenSSL


@implementer(IPlugin, IStreamServerEndpointStringParser)
class _Parser:
    prefix = "asteroid-tls"

    def parseStreamServer(self, reactor, fileno: str, cert: str, key: str):  # noqa: N802 - Twisted's interface
        with open(cert, "rb") as c, open(key, "rb") as k:
            certificate = ssl.PrivateCertificate.loadPEM(k.read() + b"\n" + c.read())
        chain = [ssl.Certificate.loadPEM(p).original for p in _rest_of_chain(cert)]
        options = ssl.CertificateOptions(
            privateKey=certificate.privateKey.original, certificate=certificate.original, extraCertChain=chain
        )
        return _Endpoint(reactor, int(fileno), options)


def _rest_of_chain(path: str) -> list[bytes]:
    """The certificates after the first in a PEM file (intermediates the lab's certificate came with)."""
    text = open(path, "rb").read()
    marker = b"-----BEGIN CERTIFICATE-----"
    parts = [marker + p for p in text.split(marker)[1:]]
    return parts[1:]


endpoint = _Parser()
