"""``dxcontract.codec``, where dxclient's users found it: the contract package shared
with the server holds it now."""

from dxcontract.codec import *  # noqa: F403
