"""``dxcontract.operators``, where dxclient's users found it: the contract package shared
with the server holds it now."""

from dxcontract.operators import *  # noqa: F403
