"""Where devices and jobs meet: the agents' socket, and staff taking a device out of service mid-job.

It imports both apps; neither imports it (jobs imports devices, devices imports neither).
"""
