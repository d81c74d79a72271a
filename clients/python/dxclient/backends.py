"""``dxcontract.backends``, where dxclient's users found it: the contract package shared
with the server holds it now."""

from dxcontract.backends import *  # noqa: F403
