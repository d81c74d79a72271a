"""``dxcontract.errors``, where dxclient's users found it: the contract package shared
with the server holds it now."""

from dxcontract.errors import *  # noqa: F403
