"""JSON API of devices (list; staff add and issue enrollment tokens) and the agents' enrollment."""

from __future__ import annotations

from django.conf import settings
from django.core.cache import cache
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST

from engine import tls
from webapp.accounts.auth import api, error, json_object
from webapp.devices.agents import disconnect_agent
from webapp.devices.forms import DeviceForm
from webapp.devices.models import Device
from webapp.lib.tokens import bearer


def agent_command(request, token: str) -> str:
    """The line to paste in the repository's directory on the board: `make agent` runs the agent with the
    checkout's own Python (made the first time), whatever `python` the board's shell has. It names the site's
    configured URL (ASTEROID_SITE_URL, from ASTEROID_HOST and ASTEROID_PORT), which the boards reach, not whatever
    address this browser used (127.0.0.1 on the site host). Over TLS it carries the pin of the site's CA bundle
    (kubeadm's discovery hash): the agent trusts nothing else."""
    line = f"make agent SERVER={settings.ASTEROID_SITE_URL} TOKEN={token}"
    if settings.ASTEROID_TLS:
        from webapp import sitetls

        line += f" CA={sitetls.pin()}"
    return line


def enrollment(request, device: Device, token: str) -> dict:
    return {"device": device.to_dict(), "enrollment_token": token, "command": agent_command(request, token)}


@api("GET", "POST")
def devices(request):
    if request.method == "GET":
        return JsonResponse({"devices": [d.to_dict() for d in Device.objects.all()]})
    if not request.user.is_staff:
        return error(403, "only staff members may add devices")
    form = DeviceForm({"kind": "jetson-nano", **request.json})
    if not form.is_valid():
        field, messages = next(iter(form.errors.items()))
        return JsonResponse({"error": f"{field}: {messages[0]}", "fields": form.errors}, status=400)
    device = form.save()
    return JsonResponse(enrollment(request, device, device.issue_enrollment()), status=201)


@api("POST", staff=True)
def token(request, device_id: int):
    """A new one-time enrollment token; the device's current credential is revoked at once."""
    device = Device.objects.filter(pk=device_id).first()
    if device is None:
        return error(404, f"no device {device_id}")
    issued = device.issue_enrollment()
    disconnect_agent(device.pk)
    return JsonResponse(enrollment(request, device, issued))


@csrf_exempt  # agents have no session; the enrollment token is the proof
@require_POST
def enroll(request):
    try:
        given = json_object(request.body).get("token")
    except ValueError as exc:
        return error(400, str(exc))
    if not isinstance(given, str) or not given:
        return error(400, 'send {"token": "ENROLLMENT_TOKEN"}')
    csr = json_object(request.body).get("csr")
    if settings.ASTEROID_TLS:  # checked before the token is spent: a bad request loses nothing
        if not isinstance(csr, str) or not csr:
            return error(400, "this site serves TLS and gives each board a certificate: send the board's certificate "
                              'request too ({"token": ..., "csr": PEM}); update the agent')  # fmt: skip
        try:
            tls.check_csr(csr.encode())
        except ValueError as exc:
            return error(400, f"csr: {exc}")
    result = Device.enroll(given)
    if result is None:
        return error(403, "unknown or already used enrollment token; ask an administrator for a new one")
    device, credential = result
    reply = {"device": device.to_dict(), "credential": credential}
    if settings.ASTEROID_TLS:
        from webapp import sitetls

        certificate, serial = sitetls.sign(csr.encode(), device.pk)
        Device.objects.filter(pk=device.pk).update(cert_serial=serial)
        reply["certificate"] = certificate.decode("ascii")
    return JsonResponse(reply)


def ca(request):
    """The CA bundle boards pin (GET, no login: it is public, and the agent checks it against the pin it was
    given before trusting it); 404 on a site that does not serve TLS."""
    if request.method != "GET":
        return error(405, "GET only")
    if not settings.ASTEROID_TLS:
        return error(404, "this site does not serve TLS (ASTEROID_TLS=0): it has no CA to pin")
    from webapp import sitetls

    return HttpResponse(sitetls.bundle(), content_type="application/x-pem-file")


LINK_PROBE_MAX_BYTES = 8 * 1024 * 1024  # workers.linkprobe.MAX_BYTES
# Boards measure their links one at a time: probes at once share the site's own link (and its CPU), so each would
# read a fraction of its rate (every agent reconnects at once after a site restart). A turn lasts this long at most.
LINK_SLOT_S = 15
LINK_SLOT_KEY = "asteroid:link-probe-slot"


@csrf_exempt  # device credential, no session
@require_http_methods(["POST", "DELETE"])
def link_slot(request):
    """An agent's turn to measure its link: POST takes it (429 with Retry-After while another board has it),
    DELETE gives it back; it lapses after LINK_SLOT_S."""
    device = Device.for_credential(bearer(request.headers.get("Authorization")))
    if device is None:
        return error(401, "unknown or revoked device credential")
    holder = cache.get(LINK_SLOT_KEY)
    if request.method == "DELETE":
        if holder == device.pk:
            cache.delete(LINK_SLOT_KEY)
        return JsonResponse({"released": True})
    if holder == device.pk or cache.add(LINK_SLOT_KEY, device.pk, LINK_SLOT_S):
        return JsonResponse({"seconds": LINK_SLOT_S})
    busy = error(429, "another board is measuring its link; try again shortly")
    busy["Retry-After"] = "1"
    return busy


@csrf_exempt  # device credential, no session
@require_POST
def link_probe(request):
    """An agent measures its link in its turn (link_slot): it sends up to 8 MiB of zeros and times this answer
    (nothing is kept)."""
    device = Device.for_credential(bearer(request.headers.get("Authorization")))
    if device is None:
        return error(401, "unknown or revoked device credential")
    declared = request.headers.get("Content-Length") or "0"
    if not declared.isdigit() or int(declared) > LINK_PROBE_MAX_BYTES:
        return error(413, f"a link probe is at most {LINK_PROBE_MAX_BYTES} bytes, got {declared[:20]!r}")
    if cache.get(LINK_SLOT_KEY) != device.pk:
        return error(409, "measure a link in its turn: POST /api/agent/link/slot/ first")
    received = 0
    while chunk := request.read(1 << 20):  # streamed, not request.body (capped at 2.5 MB, held in memory)
        received += len(chunk)
    return JsonResponse({"received": received})
