"""An agent reconnecting: a board whose cable was pulled and plugged back comes in on a new socket while the site
still holds its old one, and the old one closing is not the agent gone."""

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from tests.webapp.test_sockets import HELLO, agent_socket, enrolled, say
from webapp.devices.models import Device

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_old_connection_closing_after_a_new_one_said_hello_leaves_the_device_online():
    # a cable pulled and plugged back: the agent reconnects before the site notices its old socket is dead
    device, credential = enrolled()

    async def run():
        old = agent_socket(credential)
        assert (await old.connect())[0]
        await say(old, HELLO)
        new = agent_socket(credential)
        assert (await new.connect())[0]
        await say(new, HELLO)
        await old.disconnect()
        assert (await sync_to_async(Device.objects.get)(pk=device.pk)).status == "online"
        await new.disconnect()  # the newest connection going is the agent gone
        assert (await sync_to_async(Device.objects.get)(pk=device.pk)).status == "offline"

    async_to_sync(run)()


def test_an_old_connection_closing_before_the_new_one_says_hello_leaves_the_device_online():
    # the old socket's FIN and the new SYN reach the site together: the close is handled before the new hello is
    device, credential = enrolled()

    async def run():
        old = agent_socket(credential)
        assert (await old.connect())[0]
        await say(old, HELLO)
        new = agent_socket(credential)
        assert (await new.connect())[0]
        await old.disconnect()
        assert (await sync_to_async(Device.objects.get)(pk=device.pk)).status == "online"
        assert (await say(new, HELLO))["type"] == "welcome"
        await new.disconnect()
        assert (await sync_to_async(Device.objects.get)(pk=device.pk)).status == "offline"

    async_to_sync(run)()
