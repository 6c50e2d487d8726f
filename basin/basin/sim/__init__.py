"""The calibrated discrete-event simulator of SGLang PD agent serving (paper §4, §7.10).

`deployments` holds every calibrated constant, `costs` the timing formulas, `radix` the prefix cache,
`engine` the PD engine model (shared with the emulator), `simulator` the closed-loop session driver.
"""

from basin.sim.deployments import PRESETS, Deployment, get_deployment
from basin.sim.simulator import Simulation, SimulationConfig, SimulationResult

__all__ = ["PRESETS", "Deployment", "Simulation", "SimulationConfig", "SimulationResult", "get_deployment"]
