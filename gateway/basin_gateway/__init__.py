"""The session gateway: BASIN live in front of an SGLang PD router (docs/gateway.md).

It drives `basin.policy` objects through the same interface the simulator uses: one brain, two hosts.
"""
