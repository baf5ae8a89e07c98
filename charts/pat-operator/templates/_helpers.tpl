{{- define "pat.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "pat.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pat.labels" -}}
{{ include "pat.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pat.serviceAccountName" -}}
{{ .Values.serviceAccount.name | default (include "pat.fullname" .) }}
{{- end -}}

{{- define "pat.tokenKeySecret" -}}
{{ .Values.tokenKey.existingSecret | default (printf "%s-token-key" (include "pat.fullname" .)) }}
{{- end -}}

{{- define "pat.leaseName" -}}
{{ .Values.leaderElection.leaseName | default (include "pat.fullname" .) }}
{{- end -}}

{{- define "pat.prometheusURL" -}}
{{ .Values.prometheus.url | default .Values.prometheusURL | default "" }}
{{- end -}}

{{- /* Rules across values that values.schema.json cannot state; each error names the value and the fix. */}}
{{- define "pat.checkValues" -}}
{{- if hasKey .Values "peering" }}
{{- fail "peering: kopf peering was replaced by leader election (leaderElection.*, replicaCount); remove peering from the values" }}
{{- end }}
{{- if and .Values.prometheusURL .Values.prometheus.url }}
{{- fail "prometheusURL is the earlier name of prometheus.url: set only prometheus.url" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail (printf "replicaCount: %v replicas need leaderElection.enabled=true (else all of them would act); set replicaCount=1 or enable leader election" .Values.replicaCount) }}
{{- end }}
{{- with .Values.leaderElection }}
{{- /* client-go's rule, as the operator checks it: a retry's jitter (up to 1.2 x) still renews in time. */}}
{{- if not (and (gt (int .leaseDurationSeconds) (int .renewDeadlineSeconds)) (gt (mul 5 (int .renewDeadlineSeconds)) (mul 6 (int .retryPeriodSeconds)))) }}
{{- fail (printf "leaderElection: leaseDurationSeconds (%v) > renewDeadlineSeconds (%v) > 1.2 x retryPeriodSeconds (%v) must hold" .leaseDurationSeconds .renewDeadlineSeconds .retryPeriodSeconds) }}
{{- end }}
{{- end }}
{{- end -}}
