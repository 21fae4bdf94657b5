"""Events: `Event` (a condition that stops the solve, or changes the state and
continues) and `TimedEvent` (changes at given times), and their part in the loop
behind one interface (`_extension.py`: `start`, `init`, `step_end`, `after_step`,
`finish`)."""

from ._continuing import occurrences as occurrences
from ._conversion import (
    convert_events as convert_events,
    split_events as split_events,
)
from ._event import (
    AbstractDiscreteTerminatingEvent as AbstractDiscreteTerminatingEvent,
    as_event as as_event,
    DiscreteTerminatingEvent as DiscreteTerminatingEvent,
    Event as Event,
    steady_state_event as steady_state_event,
    SteadyStateEvent as SteadyStateEvent,
    with_context as with_context,
)
from ._extension import (
    after_step as after_step,
    finish as finish,
    init as init,
    start as start,
    step_end as step_end,
)
from ._timed import Timed as Timed, TimedEvent as TimedEvent
